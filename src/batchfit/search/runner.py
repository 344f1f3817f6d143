"""The search loop over a backend's prober and a Strategy: ``search_workload`` and ``probe_workload``.

``search_workload`` reads as its steps: plan the search (backend, device, strategy, usable bytes),
look it up in the result cache, let a trace guess the edge, run the trials, build the result.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.bounds import check_size
from batchfit.devices.accounting import LiveBytes
from batchfit.devices.base import Device
from batchfit.devices.interrupts import interrupts_deferred
from batchfit.devices.interrupts import raise_if_interrupted
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import is_users_error
from batchfit.devices.trace import undercount_message
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.errors import TraceError
from batchfit.search import distributed
from batchfit.search.allocator_report import CONFIRM_STEPS
from batchfit.search.allocator_report import allocator_report
from batchfit.search.backend import SearchBackend
from batchfit.search.backend import TrialProber
from batchfit.search.backend import backend_for
from batchfit.search.cached import CachedSearch
from batchfit.search.cached import open_cache
from batchfit.search.evidence import EvidenceChoice
from batchfit.search.evidence import after_first_trial
from batchfit.search.evidence import before_any_trial
from batchfit.search.lines_first import LinesFirst
from batchfit.search.result import SearchResult
from batchfit.search.settings import SearchSettings
from batchfit.search.settings import margin_bytes
from batchfit.search.strategies import Auto
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import Strategy
from batchfit.search.strategies import bracket
from batchfit.search.strategies import make_strategy
from batchfit.search.strategies import strategy_name
from batchfit.search.trial import Trial
from batchfit.step.compiled import CompileWatch
from batchfit.step.compiled import recompile_warning
from batchfit.step.workload import Workload

logger = logging.getLogger("batchfit")

DeviceSpec = Device | torch.device | str | None
UNBOUNDED_MAX_BATCH_SIZE = 1 << 20  # only where the device reports no capacity


def usable_bytes(device: Device, margin: int | float | str) -> tuple[int | None, int | None]:
    """The device's capacity and the bytes a trial may use: capacity minus margin (``None``: unknown)."""
    capacity = device.capacity_bytes()
    if capacity is None:
        return None, None
    kept = margin_bytes(margin, capacity)
    if kept >= capacity:
        raise InputError(
            f"margin {format_bytes(kept)} leaves nothing of the capacity {format_bytes(capacity)}: "
            "give a smaller margin (bytes, '512MiB', or a fraction such as 0.05)"
        )
    return capacity, capacity - kept


def upper_bound(
    backend: SearchBackend, workload: Any, limit_bytes: int | None, baseline_bytes: int, min_batch_size: int
) -> int:
    """The largest size a search without a cap considers: no batch larger than the free memory
    over one sample's bytes can fit (the batch alone would not)."""
    if limit_bytes is None:
        return UNBOUNDED_MAX_BATCH_SIZE
    return max(min_batch_size, (limit_bytes - baseline_bytes) // backend.bytes_per_sample(workload))


def prepared_for(backend: SearchBackend, device: Device, workload: Any) -> Any:
    """What the trials of ``workload`` run on ``device``: the backend's own preparation where it
    declares one (one rank of a sharded world builds its model inside its prober), else the device's."""
    prepare = getattr(backend, "prepare", None)
    return prepare(device, workload) if callable(prepare) else device.prepare(workload)


def device_for(workload: Any, device: DeviceSpec) -> Device:
    """The Device to probe ``workload`` on, as the workload's backend resolves ``device``."""
    return backend_for(workload).resolve_device(workload, device)


def _nothing_fits(
    trials: list[Trial], device: Device, limit_bytes: int | None, min_batch_size: int, stopped_by: str | None = None
) -> NoBatchFitsError:
    smallest = min((t.batch_size for t in trials if not t.fits), default=None)
    if smallest is None or smallest > min_batch_size:  # a limit stopped the search before the minimum
        limit = stopped_by or "max_trials"
        tried = f" (the smallest tried, {smallest}, did not fit on {device.name})" if smallest is not None else ""
        return NoBatchFitsError(
            f"{limit} ran out before any size fitted{tried}: raise {limit} or lower max_batch_size", trials
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
    the workload cannot be traced: an op without a fake kernel, data-dependent shapes, ...
    The user's own ``ValueError``/``TypeError`` propagates (the real device would raise it too);
    an op the trace under-counts is a warning (the real probes decide).

    Usually two fake trials: they draw every storage's bytes as a line in the batch size, and the
    edge is read off the lines (see ``batchfit.search.lines_first``). The answer's keys:
    ``batch_size``, ``trials`` (fake trials run), ``seconds`` and ``method`` (``"lines"``, or
    ``"search"`` when the lines could not decide and a search on fake trials went on); where the device's
    caching allocator runs without expandable segments, ``expandable_batch_size``, the edge with them.
    The trace models the device's caching allocator, if it has one (a GPU's, read from this process)."""
    start = time.perf_counter()
    allocator = getattr(device, "allocator_settings", None) or "exact"  # the device's caching allocator, if any
    target = getattr(device, "target", None)  # a trace device's GPU, whose kernels the estimate runs
    tracer = TraceDevice(limit_bytes, device=device.torch_device, allocator=allocator, target=target)
    strategy = LinesFirst(tracer.counter)
    try:
        estimate = search_workload(
            workload,
            device=tracer,
            min_batch_size=space[0],
            max_batch_size=space[1],
            steps=steps,
            trace=False,
            strategy=strategy,
        )
    except NoBatchFitsError:
        return {"batch_size": None, "trials": None, "seconds": time.perf_counter() - start, "method": strategy.method}
    except Exception as error:  # a fallback: what stops the trace but not the real device
        if is_users_error(error) or isinstance(error, distributed.RankStoppedError):
            raise  # the user's own error, or another rank's: every rank stops
        _warn_untraceable(error)
        return None
    if tracer.undercounted_ops:
        logger.warning("batchfit: %s: its edge is only a first guess", undercount_message(tracer.undercounted_ops))
    traced = {
        "batch_size": strategy.edge if strategy.edge is not None else estimate.batch_size,
        "trials": len(estimate.trials),
        "seconds": time.perf_counter() - start,
        "method": strategy.method,
    }
    if strategy.expandable_edge is not None:
        traced["expandable_batch_size"] = strategy.expandable_edge
    return traced


def _warn_untraceable(error: Exception) -> None:
    cause = error.__cause__ if isinstance(error, TraceError) and error.__cause__ is not None else error
    logger.warning(
        "batchfit: could not trace the workload (%s: %s); probing without an estimate",
        type(cause).__name__,
        (str(cause).splitlines() or [""])[0][:200],
    )


@dataclass(frozen=True)
class _Plan:
    """One search, resolved before any trial: the backend, the device, the settings, the strategy
    and the bytes a trial may use (``agreeing``: every rank runs the same trials)."""

    backend: SearchBackend
    device: Device
    settings: SearchSettings
    strategy: Strategy
    capacity_bytes: int | None
    limit_bytes: int | None
    agreeing: bool

    def cache_fields(self) -> dict[str, Any]:
        """What the result cache keys this search by, besides the workload and the device."""
        s = self.settings
        return {
            "min_batch_size": s.min_batch_size,
            "max_batch_size": s.max_batch_size,
            "limit_bytes": self.limit_bytes,
            "steps": s.steps,
            "strategy": strategy_name(self.strategy),
            "max_trials": s.max_trials,
        }


def search_workload(
    workload: Any,
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    on_trial: Callable[[Trial], None] | None = None,
    on_trial_start: Callable[[int], None] | None = None,
    **options: Any,
) -> SearchResult:
    """Find the largest batch size of ``workload`` that fits; see ``find_max_batch_size``.

    ``workload`` is a ``batchfit.Workload`` or one of another framework that declares its
    ``backend()`` (``SearchBackend``, such as the MLX integration's ``MlxWorkload``).
    ``settings`` (a ``SearchSettings``) and ``options`` (any of its fields, by keyword, applied on
    top) say how the search runs.
    ``on_trial_start(batch_size)`` and ``on_trial(trial)`` are called around every trial.
    Each trial is logged at INFO on the ``batchfit`` logger (DEBUG with ``on_trial``, or on a trace).
    ``agree`` (default: when a process group is initialised) makes all ranks agree on every trial.
    ``cache`` (``True``, a folder or a ``ResultCache``) returns a stored answer with zero trials
    when the workload's fingerprint was searched before, and stores new answers; it is not used
    across ranks.
    """
    start = time.perf_counter()
    plan = _plan(workload, SearchSettings.of(settings, **options), device)
    cached = _place_in_cache(plan, workload)
    hit = cached.lookup(start) if cached is not None else None
    if hit is not None:
        return hit
    with interrupts_deferred():  # Ctrl-C stops the search where the state can be put back whole
        plan, traced, deferred = _guess_by_trace(plan, workload)
        trials, space, reported = _run_trials(plan, workload, on_trial, on_trial_start, deferred, start)
    result = _result(plan, workload.name, trials, space, {**traced, **reported}, start)
    report = allocator_report(plan.device, result)
    if report is not None:
        result.extra["allocator"] = report
    result = _annotated(workload, result, plan.device)
    if cached is not None and "stopped_by" not in result.extra:  # an edge the clock cut short is not kept
        cached.store(result)
    return result


def _annotated(workload: Any, result: SearchResult, device: Device) -> SearchResult:
    """``result`` as a workload that says what its trials are tells it (its ``annotated(result,
    device)``: one rank of a sharded world names the mode), else as it is."""
    annotate = getattr(workload, "annotated", None)
    return annotate(result, device) if callable(annotate) else result


def _plan(workload: Any, settings: SearchSettings, device: DeviceSpec) -> _Plan:
    """The backend and device of ``workload``, the strategy (``"auto"``: the device's best default)
    and the usable bytes (under ranks, the smallest device's)."""
    backend = backend_for(workload)
    dev = backend.resolve_device(workload, device)
    capacity, limit = usable_bytes(dev, settings.margin)
    agreeing = distributed.active() if settings.agree is None else settings.agree
    if agreeing and limit is not None:
        limit = distributed.agree_min(limit)  # every rank aims at the smallest device's memory
    strategy = _strategy(backend, dev, settings.strategy, agreeing)
    return _Plan(backend, dev, settings, strategy, capacity, limit, agreeing)


def _strategy(backend: SearchBackend, device: Device, wanted: str | Strategy, agreeing: bool) -> Strategy:
    """The strategy asked for; ``"auto"``: the backend's default, which begins with the storages'
    lines (``LinesFirst``) on a device that counts every storage (on a trace device, where it models a
    caching allocator: the lines replay its requests), unless ranks must agree (each rank's storages
    could differ, and every rank must propose the same sizes)."""
    if not _is_auto(wanted):
        return make_strategy(wanted)
    strategy = make_strategy(backend.auto_strategy(device))
    counter = getattr(device, "counter", None)
    if not isinstance(strategy, Auto) or not isinstance(counter, LiveBytes) or agreeing:
        return strategy
    if not backend.is_trace(device) or counter.allocator is not None:  # fake trials replay the allocator's lines
        return LinesFirst(counter, verify=True)
    return strategy


def _is_auto(strategy: str | Strategy) -> bool:
    return isinstance(strategy, str) and strategy == "auto"


def traces_first(workload: Any, settings: SearchSettings, device: Device, limit_bytes: int | None) -> bool:
    """Whether a search of ``workload`` on ``device`` estimates the edge on fake tensors before its real
    trials: ``auto`` with ``trace``, a known usable memory, a workload that traces, not already a trace."""
    backend = backend_for(workload)
    if not (settings.trace and _is_auto(settings.strategy) and limit_bytes is not None):
        return False
    return not backend.is_trace(device) and backend.can_trace(workload)


def _guess_by_trace(plan: _Plan, workload: Any) -> tuple[_Plan, dict[str, Any], bool]:
    """With ``strategy="auto"`` and ``trace``, the cheaper evidence first (see ``evidence``): where
    the device alone says a real trial is expensive, the plan whose first guess is the trace's
    estimate and ``{"trace": ..., "evidence": ...}`` for the result's ``extra``; where the first
    real trial must be measured to decide, the plan unchanged and ``True`` (deferred)."""
    if not traces_first(workload, plan.settings, plan.device, plan.limit_bytes):
        return plan, {}, False
    choice = before_any_trial(plan.device)
    if plan.settings.trace is True:
        choice = EvidenceChoice(True, "trace=True asks for the trace first")
    if plan.agreeing:  # one plan for every rank: the trace first, as before any trial's time is known
        choice = EvidenceChoice(True, "ranks agree on every trial: the trace goes first on all of them")
    if choice is None:
        return plan, {}, True
    plan, traced = _traced_plan(plan, workload)
    return plan, {**traced, "evidence": choice.to_dict()}, False


def _traced_plan(plan: _Plan, workload: Any) -> tuple[_Plan, dict[str, Any]]:
    """The plan whose ``auto`` strategy takes the trace's estimate as its next guess, and
    ``{"trace": ...}`` (nothing when the workload could not be traced)."""
    s = plan.settings
    traced = trace_estimate(workload, plan.device, plan.limit_bytes, (s.min_batch_size, s.max_batch_size), s.steps)
    guess = traced["batch_size"] if traced is not None else None
    if plan.agreeing:  # every rank takes part, also one whose trace failed
        guess = distributed.agree_min(guess if guess is not None else 0) or None
    if guess is not None:
        plan = dataclasses.replace(plan, strategy=make_strategy("auto", guess=guess))
    return plan, ({"trace": traced} if traced is not None else {})


def _run_trials(
    plan: _Plan,
    workload: Any,
    on_trial: Callable[[Trial], None] | None,
    on_trial_start: Callable[[int], None] | None,
    deferred: bool = False,
    start: float | None = None,
) -> tuple[list[Trial], SearchSpace, dict[str, Any]]:
    """Trials until the strategy is done, or ``max_trials`` or ``max_seconds`` (counted from
    ``start``) ran out; the space they kept to; and what the search reports (``{"stopped_by":
    ...}`` when a limit stopped it; ``{"compile": ...}`` for a compiled model; with ``deferred``, the
    choice of evidence made after the first trial, and the trace if it was chosen)."""
    s = plan.settings
    prepared = prepared_for(plan.backend, plan.device, workload)
    trials: list[Trial] = []
    reported: dict[str, Any] = {}
    with plan.backend.prober(prepared, plan.device, steps=s.steps, limit_bytes=plan.limit_bytes) as prober:
        space = _space(plan, prepared, prober.baseline_bytes)
        while True:
            raise_if_interrupted()
            batch_size = plan.strategy.next(trials, space)
            if batch_size is None:
                break
            limit = _limit_reached(plan, trials, batch_size, start)
            if limit is not None:
                reported["stopped_by"] = limit
                break
            _check_proposal(batch_size, trials, space, plan.strategy)
            trials.append(_one_trial(plan, prober, batch_size, on_trial, on_trial_start))
            if deferred and len(trials) == 1:
                plan = _choose_after_first(plan, workload, trials[0], reported)
        confirmed = (
            None if "stopped_by" in reported else _confirm(plan, prober, trials, space, on_trial, on_trial_start)
        )
        if confirmed is not None:
            reported["confirmed"] = confirmed
        watch = prober.compile_watch
        if watch is not None:
            reported["compile"] = _compile_report(watch, trials)
    if isinstance(plan.strategy, LinesFirst) and plan.strategy.edge is not None:
        reported["lines"] = {"batch_size": plan.strategy.edge, "from": [t.batch_size for t in trials[:2]]}
        if plan.strategy.expandable_edge is not None:
            reported["lines"]["expandable_batch_size"] = plan.strategy.expandable_edge
    return trials, space, reported


def confirm_steps(plan: _Plan) -> int:
    """How many steps in a row confirm the answer: the settings' ``confirm_steps``, else ``CONFIRM_STEPS``
    where a caching allocator decides what fits on this (real, or simulated) device, else none."""
    wanted = plan.settings.confirm_steps
    if wanted is not None:
        return wanted
    if plan.backend.is_trace(plan.device) or getattr(plan.device, "allocator_settings", None) is None:
        return 0
    return CONFIRM_STEPS


def _confirm(
    plan: _Plan,
    prober: TrialProber,
    trials: list[Trial],
    space: SearchSpace,
    on_trial: Callable[[Trial], None] | None,
    on_trial_start: Callable[[int], None] | None,
) -> dict[str, Any] | None:
    """Try the answer again for ``confirm_steps`` steps in a row, from an emptied cache as training starts (a
    caching allocator's state after a few steps is not its state after two); where it fails, go down (1, 2, 4,
    ... below) until a size holds, then bisect. Every confirmation is a trial; ``None`` when none is due."""
    steps = confirm_steps(plan)
    lo, _ = bracket(trials, space)
    if not steps or lo < space.min_batch_size:
        return None
    held, failed, gap, size = None, None, 1, lo
    while held is None and size >= space.min_batch_size:
        trial = _one_trial(plan, prober, size, on_trial, on_trial_start, steps=steps)
        trials.append(trial)
        if trial.fits:
            held = size
        else:
            failed, size, gap = size, size - gap, gap * 2
    while held is not None and failed is not None and failed - held > 1:
        middle = (held + failed) // 2
        trial = _one_trial(plan, prober, middle, on_trial, on_trial_start, steps=steps)
        trials.append(trial)
        held, failed = (middle, failed) if trial.fits else (held, middle)
    return {"steps": steps, "batch_size": held, "from": lo}


def _limit_reached(plan: _Plan, trials: list[Trial], batch_size: int, start: float | None) -> str | None:
    """``"max_trials"`` or ``"max_seconds"`` when that limit forbids the trial at ``batch_size``,
    else ``None``: no trial starts that would end past ``max_seconds``, as predicted from the
    largest trial that fitted (its seconds per sample); ranks that agree stop together."""
    s = plan.settings
    limit = None
    if s.max_trials is not None and len(trials) >= s.max_trials:
        limit = "max_trials"
    elif s.max_seconds is not None and start is not None and _ends_past(s.max_seconds, start, trials, batch_size):
        limit = "max_seconds"
    if plan.agreeing and s.max_seconds is not None:
        stops = distributed.agree_min(0 if limit else 1) == 0  # one rank out of time stops them all
        limit = (limit or "max_seconds") if stops else None
    return limit


def _ends_past(max_seconds: float, start: float, trials: list[Trial], batch_size: int) -> bool:
    """Whether a trial at ``batch_size``, started now, would end past ``max_seconds`` from ``start``."""
    return time.perf_counter() - start + _predicted_seconds(trials, batch_size) >= max_seconds


def _predicted_seconds(trials: list[Trial], batch_size: int) -> float:
    """What a trial at ``batch_size`` will take, at the largest fitted trial's seconds per sample
    (0 before any trial fitted: the first trial always runs if the budget has time left)."""
    fitted = [t for t in trials if t.fits]
    if not fitted:
        return 0.0
    largest = max(fitted, key=lambda t: t.batch_size)
    return largest.seconds * batch_size / largest.batch_size


def _choose_after_first(plan: _Plan, workload: Any, first: Trial, reported: dict[str, Any]) -> _Plan:
    """After the first real trial: trace if that is predicted to cost less than the trial did
    (and it fitted, so there is an edge above it to estimate); the choice goes to ``reported``."""
    choice = after_first_trial(first)
    reported["evidence"] = choice.to_dict()
    if not choice.trace_first:
        return plan
    plan, traced = _traced_plan(plan, workload)
    reported.update(traced)
    return plan


def _space(plan: _Plan, workload: Any, baseline_bytes: int) -> SearchSpace:
    """The sizes to search: from the minimum to the caller's cap, else to the ``upper_bound``."""
    s = plan.settings
    top = s.max_batch_size or upper_bound(plan.backend, workload, plan.limit_bytes, baseline_bytes, s.min_batch_size)
    if plan.agreeing:
        top = distributed.agree_min(top)
    return SearchSpace(s.min_batch_size, top, plan.limit_bytes)


def _one_trial(
    plan: _Plan,
    prober: TrialProber,
    batch_size: int,
    on_trial: Callable[[Trial], None] | None,
    on_trial_start: Callable[[int], None] | None,
    steps: int | None = None,
) -> Trial:
    """Probe ``batch_size`` (``steps`` full steps, default the search's; under ranks: it fits only if it fit
    on every rank), log it, report it."""
    if on_trial_start is not None:
        on_trial_start(batch_size)
    probe = prober.probe if steps is None else functools.partial(prober.probe, steps=steps)
    # Agreeing, a rank whose trial raises tells the others in this trial's agreement.
    trial = distributed.probe_together(probe, batch_size) if plan.agreeing else probe(batch_size)
    # A caller with on_trial reports trials itself; a trace's trials are only an estimate.
    quiet = on_trial is not None or plan.backend.is_trace(plan.device)
    logger.log(logging.DEBUG if quiet else logging.INFO, trial.describe(plan.capacity_bytes))
    if on_trial is not None:
        on_trial(trial)
    return trial


def _result(
    plan: _Plan, workload_name: str | None, trials: list[Trial], space: SearchSpace, extra: dict[str, Any], start: float
) -> SearchResult:
    """The answer: the largest size that fitted below the smallest that failed; ``NoBatchFitsError`` if none."""
    s = plan.settings
    lo, hi = bracket(trials, space)
    if lo < s.min_batch_size:
        raise _nothing_fits(trials, plan.device, plan.limit_bytes, s.min_batch_size, extra.get("stopped_by"))
    return SearchResult(
        batch_size=lo,
        trials=trials,
        strategy=strategy_name(plan.strategy),
        capacity_bytes=plan.capacity_bytes,
        limit_bytes=plan.limit_bytes,
        device=plan.device.name,
        min_batch_size=s.min_batch_size,
        max_batch_size=s.max_batch_size,
        upper_bound=space.max_batch_size,
        exact=hi - lo == 1,
        seconds=time.perf_counter() - start,
        workload=workload_name,
        extra=extra,
    )


def _compile_report(watch: CompileWatch, trials: list[Trial]) -> dict[str, int]:
    """Graphs dynamo compiled for the trials of a compiled model; a warning when sizes recompiled."""
    report = watch.report(sizes=len({t.batch_size for t in trials}))
    warning = recompile_warning(report)
    if warning is not None:
        logger.warning("batchfit: %s", warning)
    return report


def _place_in_cache(plan: _Plan, workload: Any) -> CachedSearch | None:
    """Where this search's answer is kept, or ``None``: no cache, or ranks (which could disagree on a hit)."""
    opened = open_cache(plan.settings.cache) if not plan.agreeing else None
    if opened is None:
        return None
    if not isinstance(workload, Workload):
        raise InputError("the result cache fingerprints torch workloads only: search this workload without cache")
    return CachedSearch.make(opened, workload, plan.device, plan.cache_fields())


def _check_proposal(batch_size: int, trials: list[Trial], space: SearchSpace, strategy: Strategy) -> None:
    tried = {t.batch_size for t in trials}
    if batch_size in tried or not space.min_batch_size <= batch_size <= space.max_batch_size:
        raise RuntimeError(f"strategy {strategy!r} proposed batch size {batch_size}, already tried or outside {space}")


def probe_workload(
    workload: Any, batch_size: int, settings: SearchSettings | None = None, *, device: DeviceSpec = None, **options: Any
) -> Trial:
    """Run one trial of ``workload`` (torch's, or one that declares its ``backend()``) at
    ``batch_size`` and return it; state is restored afterwards. Of the settings (``settings``
    and/or ``options``), ``margin`` and ``steps`` apply."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be an integer of at least 1, got {batch_size!r}")
    check_size("batch_size", batch_size)
    s = SearchSettings.of(settings, **options)
    backend = backend_for(workload)
    dev = backend.resolve_device(workload, device)
    capacity, limit = usable_bytes(dev, s.margin)
    with (
        interrupts_deferred(),
        backend.prober(prepared_for(backend, dev, workload), dev, steps=s.steps, limit_bytes=limit) as prober,
    ):
        trial = prober.probe(batch_size)
    logger.info(trial.describe(capacity))
    return trial
