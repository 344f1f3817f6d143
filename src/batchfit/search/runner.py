"""find_max_batch_size and probe_batch_size: the search loop over a Prober and a Strategy."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from batchfit.devices.base import Device
from batchfit.devices.resolve import resolve_device
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import NoBatchFitsError
from batchfit.search import distributed
from batchfit.search.cached import CachedSearch
from batchfit.search.cached import CacheSpec
from batchfit.search.cached import open_cache
from batchfit.search.prober import Prober
from batchfit.search.result import SearchResult
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import Strategy
from batchfit.search.strategies import bracket
from batchfit.search.strategies import make_strategy
from batchfit.search.trial import Trial
from batchfit.step.batching import bytes_per_sample
from batchfit.step.batching import pad_sequences
from batchfit.step.compiled import CompileWatch
from batchfit.step.compiled import recompile_warning
from batchfit.step.workload import Workload

logger = logging.getLogger("batchfit")

DeviceSpec = Device | torch.device | str | None
UNBOUNDED_MAX_BATCH_SIZE = 1 << 20  # only where the device reports no capacity


def margin_bytes(margin: int | float | str, capacity_bytes: int | None) -> int:
    """Headroom in bytes: an int or a size string, or a fraction of the capacity in ``[0, 1)``."""
    if isinstance(margin, bool):
        raise TypeError(f"margin must be bytes, a size string or a fraction, got {margin!r}")
    if isinstance(margin, float):
        if not 0 <= margin < 1:
            raise ValueError(f"a fractional margin must be in [0, 1), got {margin=}")
        return int(margin * capacity_bytes) if capacity_bytes else 0
    if margin == 0:
        return 0
    return parse_bytes(margin, what="margin")


def usable_bytes(device: Device, margin: int | float | str) -> tuple[int | None, int | None]:
    """The device's capacity and the bytes a trial may use: capacity minus margin (``None``: unknown)."""
    capacity = device.capacity_bytes()
    if capacity is None:
        return None, None
    kept = margin_bytes(margin, capacity)
    if kept >= capacity:
        raise ValueError(
            f"margin {format_bytes(kept)} leaves nothing of the capacity {format_bytes(capacity)}: "
            "give a smaller margin (bytes, '512MiB', or a fraction such as 0.05)"
        )
    return capacity, capacity - kept


def _upper_bound(workload: Workload, limit_bytes: int | None, baseline_bytes: int, min_batch_size: int) -> int:
    """No batch larger than the free memory divided by one sample's bytes can fit: the batch alone
    would not."""
    if limit_bytes is None:
        return UNBOUNDED_MAX_BATCH_SIZE
    own = getattr(workload, "bytes_per_sample", None)  # a workload of another framework (MLX) measures its own
    per_sample = own() if own is not None else bytes_per_sample(workload.sample_batch)
    return max(min_batch_size, (limit_bytes - baseline_bytes) // per_sample)


def device_for(workload: Any, device: DeviceSpec) -> Device:
    """The Device to probe ``workload`` on; a workload of another framework (MLX) resolves its own."""
    own = getattr(workload, "resolve_device", None)
    return own(device) if own is not None else resolve_device(device, workload.model)


def _prober(workload: Any, device: Device, steps: int, limit_bytes: int | None) -> Any:
    """The device's own prober where it has one (MLX), else torch's ``Prober``."""
    own = getattr(device, "prober", None)
    if own is not None:
        return own(workload, steps=steps, limit_bytes=limit_bytes)
    return Prober(workload, device, steps=steps, limit_bytes=limit_bytes)


def _nothing_fits(
    trials: list[Trial], device: Device, limit_bytes: int | None, min_batch_size: int
) -> NoBatchFitsError:
    smallest = min(t.batch_size for t in trials if not t.fits)
    if smallest > min_batch_size:  # max_trials ran out before the search got down to the minimum
        return NoBatchFitsError(
            f"max_trials ran out before any size fitted (the smallest tried, {smallest}, did not fit on {device.name}): "
            "raise max_trials or lower max_batch_size",
            trials,
        )
    return NoBatchFitsError(
        f"even batch size {smallest} does not fit on {device.name} (usable {format_bytes(limit_bytes)}): "
        "use AMP, gradient checkpointing, a smaller model or sequence, or more memory",
        trials,
    )


def trace_estimate(
    workload: Workload, device: Device, limit_bytes: int, space: tuple[int, int | None], steps: int
) -> dict[str, Any] | None:
    """The trace's estimate of the edge under ``limit_bytes``, or ``None`` (with a warning) when
    the workload cannot be traced: an op without a fake kernel, data-dependent shapes, ..."""
    from batchfit.devices.trace import TraceDevice

    start = time.perf_counter()
    tracer = TraceDevice(limit_bytes, device=device.torch_device)
    try:
        estimate = search_workload(
            workload, device=tracer, min_batch_size=space[0], max_batch_size=space[1], steps=steps, trace=False
        )
    except NoBatchFitsError:
        return {"batch_size": None, "trials": None, "seconds": time.perf_counter() - start}
    except Exception as error:  # a fallback: whatever stops the trace, real probing still works
        logger.warning(
            "batchfit: could not trace the workload (%s: %s); probing without an estimate",
            type(error).__name__,
            str(error).splitlines()[0][:200],
        )
        return None
    return {"batch_size": estimate.batch_size, "trials": len(estimate.trials), "seconds": time.perf_counter() - start}


def search_workload(
    workload: Workload,
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    on_trial: Callable[[Trial], None] | None = None,
    on_trial_start: Callable[[int], None] | None = None,
    **options: Any,
) -> SearchResult:
    """Find the largest batch size of ``workload`` that fits; see ``find_max_batch_size``.

    ``settings`` (a ``SearchSettings``) and ``options`` (any of its fields, by keyword, applied on
    top) say how the search runs.
    ``on_trial_start(batch_size)`` and ``on_trial(trial)`` are called around every trial.
    Each trial is logged at INFO on the ``batchfit`` logger (DEBUG with ``on_trial``, or on a trace).
    ``agree`` (default: when a process group is initialised) makes all ranks agree on every trial.
    ``cache`` (``True``, a folder or a ``ResultCache``) returns a stored answer with zero trials
    when the workload's fingerprint was searched before, and stores new answers; it is not used
    across ranks.
    """
    s = SearchSettings.of(settings, **options)
    min_batch_size, max_batch_size, strategy, max_trials, steps = (
        s.min_batch_size,
        s.max_batch_size,
        s.strategy,
        s.max_trials,
        s.steps,
    )
    start = time.perf_counter()
    dev = device_for(workload, device)
    # "auto" is the device's best default: a device without per-op timelines (MLX) may name another.
    chosen = make_strategy(getattr(dev, "auto_strategy", strategy) if strategy == "auto" else strategy)
    capacity, limit = usable_bytes(dev, s.margin)
    agreeing = distributed.active() if s.agree is None else s.agree
    if agreeing and limit is not None:
        limit = distributed.agree_min(limit)  # every rank aims at the smallest device's memory
    settings = {
        "min_batch_size": min_batch_size,
        "max_batch_size": max_batch_size,
        "limit_bytes": limit,
        "steps": steps,
        "strategy": getattr(chosen, "name", None),
        "max_trials": max_trials,
    }
    cached = _place_in_cache(s.cache, agreeing, workload, dev, settings)
    hit = cached.lookup(start) if cached is not None else None
    if hit is not None:
        return hit
    traced = None
    traceable = isinstance(workload, Workload) and not getattr(dev, "traces", False)  # a torch workload, not traced yet
    if s.trace and strategy == "auto" and limit is not None and traceable:
        traced = trace_estimate(workload, dev, limit, (min_batch_size, max_batch_size), steps)
        guess = traced["batch_size"] if traced is not None else None
        if agreeing:
            guess = distributed.agree_min(guess if guess is not None else 0) or None
        if guess is not None:
            chosen = make_strategy("auto", guess=guess)
    workload = dev.prepare(workload)
    trials: list[Trial] = []
    with _prober(workload, dev, steps, limit) as prober:
        top = max_batch_size or _upper_bound(workload, limit, prober.baseline_bytes, min_batch_size)
        if agreeing:
            top = distributed.agree_min(top)
        space = SearchSpace(min_batch_size, top, limit)
        while max_trials is None or len(trials) < max_trials:
            batch_size = chosen.next(trials, space)
            if batch_size is None:
                break
            _check_proposal(batch_size, trials, space, chosen)
            if on_trial_start is not None:
                on_trial_start(batch_size)
            trial = prober.probe(batch_size)
            if agreeing:
                trial = distributed.agree_trial(trial)  # fits only if it fit on every rank
            trials.append(trial)
            # A caller with on_trial reports trials itself; a trace's trials are only an estimate.
            quiet = on_trial is not None or getattr(dev, "traces", False)
            logger.log(logging.DEBUG if quiet else logging.INFO, trial.describe(capacity))
            if on_trial is not None:
                on_trial(trial)
        extra: dict[str, Any] = {"trace": traced} if traced is not None else {}
        if prober.compile_watch is not None:
            extra["compile"] = _compile_report(prober.compile_watch, trials)
    lo, hi = bracket(trials, space)
    if lo < min_batch_size:
        raise _nothing_fits(trials, dev, limit, min_batch_size)
    result = SearchResult(
        batch_size=lo,
        trials=trials,
        strategy=getattr(chosen, "name", type(chosen).__name__),
        capacity_bytes=capacity,
        limit_bytes=limit,
        device=dev.name,
        min_batch_size=min_batch_size,
        max_batch_size=top,
        exact=hi - lo == 1,
        seconds=time.perf_counter() - start,
        workload=workload.name,
        extra=extra,
    )
    if cached is not None:
        cached.store(result)
    return result


def _compile_report(watch: CompileWatch, trials: list[Trial]) -> dict[str, int]:
    """Graphs dynamo compiled for the trials of a compiled model; a warning when sizes recompiled."""
    report = watch.report(sizes=len(trials))
    warning = recompile_warning(report)
    if warning is not None:
        logger.warning("batchfit: %s", warning)
    return report


def _place_in_cache(
    cache: CacheSpec, agreeing: bool, workload: Workload, device: Device, settings: dict[str, Any]
) -> CachedSearch | None:
    """Where this search's answer is kept, or ``None``: no cache, or ranks (which could disagree on a hit)."""
    opened = open_cache(cache) if not agreeing else None
    if opened is not None and not isinstance(workload, Workload):
        raise ValueError("the result cache fingerprints torch workloads only: search this workload without cache")
    return CachedSearch.make(opened, workload, device, settings) if opened is not None else None


def _check_proposal(batch_size: int, trials: list[Trial], space: SearchSpace, strategy: Strategy) -> None:
    tried = {t.batch_size for t in trials}
    if batch_size in tried or not space.min_batch_size <= batch_size <= space.max_batch_size:
        raise RuntimeError(f"strategy {strategy!r} proposed batch size {batch_size}, already tried or outside {space}")


def find_max_batch_size(
    model: torch.nn.Module,
    sample_batch: Any,
    *,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: DeviceSpec = None,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    strategy: str | Strategy = "auto",
    margin: int | float | str = 0,
    max_trials: int | None = None,
    steps: int = 2,
    mode: str = "train",
    step_fn: Callable | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    trace: bool = True,
    longest_seq_len: int | None = None,
    cache: CacheSpec = False,
) -> SearchResult:
    """The largest batch size that really fits: every answer is a size a trial ran.

    Each trial runs ``steps`` (at least 2) full training steps (forward, loss, backward,
    optimizer step, AMP if ``amp_dtype``) on a batch built from ``sample_batch``; an
    out-of-memory error marks the size as failing and everything is restored. ``device=None``
    probes where the model is; ``"sim:8GiB"`` or ``SimulatedDevice("8GiB")`` simulates a GPU on the
    CPU. ``margin`` keeps headroom (bytes, ``"512MiB"`` or a fraction such as ``0.05``). Under an
    initialised ``torch.distributed`` process group every rank runs the same trials and all ranks
    return the same size: the largest that fits on every one of them.
    ``strategy``: ``auto`` (default), ``binary``, ``power``, ``grow``, ``halving``. With
    ``auto`` and ``trace=True``, the edge is first estimated on a ``TraceDevice`` (fake tensors,
    nothing allocated) and real trials only verify and refine it. ``longest_seq_len`` pads every
    sequence of the sample to the longest length the run will see (masks fully attended), so the
    answer holds for the worst batch, not the sample's. ``cache=True`` (or a folder) returns a
    stored answer, with zero trials, when this very search ran before (see ``ResultCache``).

    >>> import batchfit as bf
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    >>> batch = (torch.randn(4, 64), torch.randint(0, 10, (4,)))
    >>> result = bf.find_max_batch_size(model, batch, loss_fn=torch.nn.functional.cross_entropy,
    ...     optimizer=torch.optim.Adam(model.parameters()), device=bf.SimulatedDevice("2MiB"))
    >>> result.batch_size > 0 and result.trials[-1].batch_size in (result.batch_size, result.batch_size + 1)
    True
    """
    if longest_seq_len is not None:
        sample_batch = pad_sequences(sample_batch, longest_seq_len)
    workload = Workload(
        model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, amp_dtype=amp_dtype, mode=mode, step_fn=step_fn
    )
    return search_workload(
        workload,
        device=device,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        strategy=strategy,
        margin=margin,
        max_trials=max_trials,
        steps=steps,
        on_trial=on_trial,
        trace=trace,
        cache=cache,
    )


def probe_batch_size(
    model: torch.nn.Module,
    sample_batch: Any,
    batch_size: int,
    *,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: DeviceSpec = None,
    margin: int | float | str = 0,
    steps: int = 2,
    mode: str = "train",
    step_fn: Callable | None = None,
) -> Trial:
    """Run one trial at ``batch_size`` and return it; state is restored afterwards.

    >>> model = torch.nn.Linear(8, 1)
    >>> trial = probe_batch_size(model, torch.randn(2, 8), 16, loss_fn=lambda out, batch: out.mean(),
    ...                          device="sim:1MiB")
    >>> trial.fits, trial.steps
    (True, 2)
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer of at least 1, got {batch_size!r}")
    workload = Workload(
        model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, amp_dtype=amp_dtype, mode=mode, step_fn=step_fn
    )
    dev = resolve_device(device, workload.model)
    capacity, limit = usable_bytes(dev, margin)
    workload = dev.prepare(workload)
    with Prober(workload, dev, steps=steps, limit_bytes=limit) as prober:
        trial = prober.probe(batch_size)
    logger.info(trial.describe(capacity))
    return trial
