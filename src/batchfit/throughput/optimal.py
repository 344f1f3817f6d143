"""Maximum is not optimal: the smallest batch whose throughput is within a tolerance of the best.

Steady-state step time is measured at a geometric grid of batch sizes up to the largest that
fits (warm-up steps excluded, the median of several timed steps, the device synchronised), then
refined near the knee. Step time is also fitted as t(B) = alpha + beta*B, whose throughput
B/t(B) reaches a fraction f of its ceiling 1/beta at B = f/(1-f) * alpha/beta: the 90% knee is
9*alpha/beta and the 95% knee 19*alpha/beta.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from batchfit.devices.resolve import resolve_device
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.search.cached import CacheSpec
from batchfit.search.prober import Prober
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.runner import usable_bytes
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import Strategy
from batchfit.step.workload import Workload
from batchfit.throughput.result import ThroughputPoint
from batchfit.throughput.result import ThroughputResult


def _grid(low: int, top: int) -> list[int]:
    """``low``, the powers of two between ``low`` and ``top``, and ``top``.

    >>> _grid(1, 12), _grid(3, 20)
    ([1, 2, 4, 8, 12], [3, 4, 8, 16, 20])
    """
    sizes = [1 << k for k in range(int(math.log2(top)) + 1)]
    return sorted({low, *(b for b in sizes if b >= low), top})


def _fit_line(points: list[ThroughputPoint]) -> tuple[float, float]:
    if len(points) < 2:
        return points[0].step_seconds, 0.0
    sizes = np.array([p.batch_size for p in points], dtype=float)
    times = np.array([p.step_seconds for p in points], dtype=float)
    beta, alpha = np.polyfit(sizes, times, 1)
    return float(alpha), float(beta)


class _Meter:
    """Times a workload at one batch size after another, state restored after each."""

    def __init__(
        self, prober: Prober, timing_warmup_steps: int, tokens_per_sample: int | None, dataset_size: int | None
    ):
        self.prober, self.timing_warmup_steps = prober, timing_warmup_steps
        self.tokens_per_sample, self.dataset_size = tokens_per_sample, dataset_size
        self.points: dict[int, ThroughputPoint] = {}

    def measure(self, batch_size: int) -> ThroughputPoint | None:
        if batch_size not in self.points:
            trial = self.prober.probe(batch_size)
            if not trial.fits:
                return None
            seconds = statistics.median(trial.step_seconds[self.timing_warmup_steps :])
            rate = batch_size / seconds if seconds > 0 else math.inf
            tokens = rate * self.tokens_per_sample if self.tokens_per_sample else None
            epoch = math.ceil(self.dataset_size / batch_size) * seconds if self.dataset_size else None
            self.points[batch_size] = ThroughputPoint(batch_size, seconds, rate, tokens, trial.peak_bytes, epoch)
        return self.points[batch_size]

    def within(self, tolerance: float) -> list[ThroughputPoint]:
        best = max(p.samples_per_second for p in self.points.values())
        return sorted(
            (p for p in self.points.values() if p.samples_per_second >= (1 - tolerance) * best),
            key=lambda p: p.batch_size,
        )


def _refine(meter: _Meter, tolerance: float, rounds: int) -> None:
    """Bisect (geometrically) between the smallest size within tolerance and the size below it."""
    for _ in range(rounds):
        good = meter.within(tolerance)[0].batch_size
        below = max((b for b in meter.points if b < good), default=None)
        if below is None or good - below <= 1:
            return
        middle = round(math.sqrt(below * good))
        if middle in (below, good) or meter.measure(middle) is None:
            return


def _choose(meter: _Meter, tolerance: float, time_budget_seconds: float | None) -> tuple[int, str, list[str]]:
    candidates = meter.within(tolerance)
    reason = f"It is the smallest batch within {tolerance:.0%} of the best throughput."
    if time_budget_seconds is None:
        return candidates[0].batch_size, reason, []
    fitting = sorted(
        (p for p in meter.points.values() if p.epoch_seconds <= time_budget_seconds), key=lambda p: p.batch_size
    )
    if fitting:
        return (
            fitting[0].batch_size,
            f"It is the smallest batch whose projected epoch ({fitting[0].epoch_seconds:.1f} s) fits the {time_budget_seconds:g} s budget.",
            [],
        )
    fastest = min(meter.points.values(), key=lambda p: p.epoch_seconds)
    note = f"no batch size meets the {time_budget_seconds:g} s epoch budget: the fastest epoch is {fastest.epoch_seconds:.1f} s at {fastest.batch_size}"
    return fastest.batch_size, "It has the fastest projected epoch.", [note]


def find_optimal_batch_size(
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
    tolerance: float = 0.05,
    safety_fraction: float | None = None,
    timing_warmup_steps: int = 2,
    timed_steps: int = 5,
    refine_rounds: int = 3,
    tokens_per_sample: int | None = None,
    dataset_size: int | None = None,
    time_budget_seconds: float | None = None,
    mode: str = "train",
    step_fn: Callable | None = None,
    keep_output: bool = True,
    trace: bool | str = "auto",
    cache: CacheSpec = False,
    clock: Callable[[], float] = time.perf_counter,
    warmup_steps: int | None = None,
    settings: SearchSettings | None = None,
) -> ThroughputResult:
    """The throughput-optimal batch: the smallest within ``tolerance`` of the best samples/s.

    ``max_batch_size`` (else found first, as ``find_max_batch_size`` would with the same
    ``min_batch_size``, ``strategy``, ``margin``, ``trace`` and ``cache``) bounds the grid, which
    starts at ``min_batch_size``; ``margin`` is also kept free while timing. ``safety_fraction``
    (e.g. 0.8, headroom for longer sequences or evaluation) keeps the grid below that share of the
    maximum. Each size runs ``timing_warmup_steps`` untimed steps, then ``timed_steps`` timed ones
    (their median counts). ``tokens_per_sample`` adds tokens/s. With ``dataset_size`` and
    ``time_budget_seconds``, the choice is the smallest batch whose projected epoch time fits the
    budget. The device passed in is left exactly as it was. ``warmup_steps`` is the old name of
    ``timing_warmup_steps`` (deprecated: it read as the learning-rate warmup of ``plan_batch``).
    ``settings`` (a ``SearchSettings``) gives the search settings in one object; ``min_batch_size``,
    ``max_batch_size``, ``strategy``, ``margin``, ``trace`` and ``cache`` are its aliases (one form or the other).

    >>> model = torch.nn.Linear(8, 1)
    >>> result = find_optimal_batch_size(model, torch.randn(2, 8), step_fn=lambda m, b: m(b).mean(),
    ...                                  device="sim:1MiB", max_batch_size=8, timed_steps=1)
    >>> result.largest_batch_size, 1 <= result.batch_size <= 8
    (8, True)
    """
    if warmup_steps is not None:
        warnings.warn(
            "find_optimal_batch_size(warmup_steps=) is now timing_warmup_steps=", DeprecationWarning, stacklevel=2
        )
        timing_warmup_steps = warmup_steps
    workload = Workload(
        model,
        sample_batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        amp_dtype=amp_dtype,
        mode=mode,
        step_fn=step_fn,
        keep_output=keep_output,
    )
    settings = SearchSettings.merged(
        settings,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        strategy=strategy,
        margin=margin,
        trace=trace,
        cache=cache,
    )
    check_maximum(settings.max_batch_size)
    return optimal_for_workload(
        workload,
        settings,
        device=device,
        tolerance=tolerance,
        safety_fraction=safety_fraction,
        timing_warmup_steps=timing_warmup_steps,
        timed_steps=timed_steps,
        refine_rounds=refine_rounds,
        tokens_per_sample=tokens_per_sample,
        dataset_size=dataset_size,
        time_budget_seconds=time_budget_seconds,
        clock=clock,
    )


def check_maximum(max_batch_size: Any) -> None:
    """A ``ValueError`` unless ``max_batch_size`` is ``None`` or a positive integer."""
    if max_batch_size is not None and (
        not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1
    ):
        raise InputError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")


def _check(
    tolerance: float,
    safety_fraction: float | None,
    timing_warmup_steps: int,
    timed_steps: int,
    dataset_size: int | None,
    time_budget_seconds: float | None,
) -> None:
    if not 0 <= tolerance < 1:
        raise InputError(f"tolerance must be in [0, 1), got {tolerance=}")
    if safety_fraction is not None and not 0 < safety_fraction <= 1:
        raise InputError(f"safety_fraction must be in (0, 1], got {safety_fraction=}")
    if timing_warmup_steps < 0 or timed_steps < 1:
        raise InputError(
            f"need timing_warmup_steps >= 0 and timed_steps >= 1, got {timing_warmup_steps=}, {timed_steps=}"
        )
    if time_budget_seconds is not None and dataset_size is None:
        raise InputError("a time budget needs dataset_size (samples per epoch) to project epoch times")


@contextmanager
def _timeline_off(device: Any) -> Iterator[None]:
    """A device that records a per-op timeline (CUDA) stops while steps are timed, since reading
    the allocator after every op would be timed too; it records again afterwards, as before."""
    recording = getattr(device, "record_timeline", None)
    if not recording:
        yield
        return
    device.record_timeline = False
    try:
        yield
    finally:
        device.record_timeline = recording


def optimal_for_workload(
    workload: Workload,
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    tolerance: float = 0.05,
    safety_fraction: float | None = None,
    timing_warmup_steps: int = 2,
    timed_steps: int = 5,
    refine_rounds: int = 3,
    tokens_per_sample: int | None = None,
    dataset_size: int | None = None,
    time_budget_seconds: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
    **options: Any,
) -> ThroughputResult:
    """``find_optimal_batch_size`` for a ``Workload``: ``settings`` (a ``SearchSettings``) and
    ``options`` (any of its fields, by keyword) say how the maximum is searched and what is kept
    free, as in ``search_workload``."""
    _check(tolerance, safety_fraction, timing_warmup_steps, timed_steps, dataset_size, time_budget_seconds)
    check_maximum(options.get("max_batch_size"))
    s = SearchSettings.of(settings, **options)
    dev = resolve_device(device, workload.model)
    maximum = s.max_batch_size or search_workload(workload, s, device=dev).batch_size
    top = max(s.min_batch_size, math.floor(maximum * safety_fraction)) if safety_fraction else maximum
    _capacity, limit = usable_bytes(dev, s.margin)
    steps = timing_warmup_steps + timed_steps
    with _timeline_off(dev), Prober(dev.prepare(workload), dev, steps=steps, limit_bytes=limit, clock=clock) as prober:
        meter = _Meter(prober, timing_warmup_steps, tokens_per_sample, dataset_size)
        for size in _grid(s.min_batch_size, top):
            if meter.measure(size) is None:
                break
        if not meter.points:
            raise NoBatchFitsError(
                f"even batch size {s.min_batch_size} does not fit on {dev.name} while timing steps: "
                "free memory or lower the model's",
                [],
            )
        _refine(meter, tolerance, refine_rounds)
    return _result(meter, tolerance, time_budget_seconds, maximum, top, safety_fraction)


def _result(
    meter: _Meter,
    tolerance: float,
    time_budget_seconds: float | None,
    maximum: int,
    top: int,
    safety_fraction: float | None,
) -> ThroughputResult:
    chosen, reason, notes = _choose(meter, tolerance, time_budget_seconds)
    points = sorted(meter.points.values(), key=lambda p: p.batch_size)
    best = max(points, key=lambda p: p.samples_per_second).batch_size
    alpha, beta = _fit_line(points)
    largest = meter.points.get(top)
    saved = largest.peak_bytes - meter.points[chosen].peak_bytes if largest and largest.peak_bytes is not None else None
    if safety_fraction:
        notes.append(f"kept below {safety_fraction:.0%} of the maximum ({maximum}): at most {top}")
    return ThroughputResult(chosen, best, maximum, tolerance, points, alpha, beta, reason, saved, notes)
