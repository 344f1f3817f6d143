"""Maximum is not optimal: the smallest batch whose throughput is within a tolerance of the best.

Steady-state step time is measured at a geometric grid of batch sizes up to the largest that
fits (warm-up steps excluded, the median of several timed steps, the device synchronised), then
refined near the knee. Step time is also fitted as t(B) = alpha + beta*B, whose throughput
B/t(B) reaches a fraction f of its ceiling 1/beta at B = f/(1-f) * alpha/beta: the 90% knee is
9*alpha/beta and the 95% knee 19*alpha/beta.

Timings are noisy, and on some devices (a tiny model on a CPU) the batch hardly changes them. Each
point keeps the spread of its timed steps; where the fit's per-sample cost is negative, or other sizes'
fastest and slowest steps overlap the best's, those sizes are timed again with more steps (once).
If every size then runs within the timing noise of the best (their interquartile ranges of samples/s
overlap), or the per-sample cost is still negative, the result is marked not ``distinguishable``
and says so, giving the smallest size within that noise. A time limit (``max_seconds``) starts no new
size once it has passed, and the answer comes from what was measured.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from batchfit.devices.resolve import resolve_device
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.errors import NoBatchFitsError
from batchfit.search.cached import CacheSpec
from batchfit.search.prober import Prober
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.runner import usable_bytes
from batchfit.search.settings import SearchSettings
from batchfit.search.settings import check_seconds
from batchfit.search.strategies import Strategy
from batchfit.step.workload import Workload
from batchfit.throughput.result import ThroughputPoint
from batchfit.throughput.result import ThroughputResult
from batchfit.throughput.result import rate

PointCallback = Callable[[ThroughputPoint], None]


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
    """Times a workload at one batch size after another, state restored after each; reports each point
    to ``on_point``, and starts no new size once the prober's clock has passed ``deadline`` (the first
    size always runs, so that there is an answer)."""

    def __init__(
        self,
        prober: Prober,
        timing_warmup_steps: int,
        tokens_per_sample: int | None,
        dataset_size: int | None,
        on_point: PointCallback | None = None,
        deadline: float | None = None,
    ):
        self.prober, self.timing_warmup_steps = prober, timing_warmup_steps
        self.tokens_per_sample, self.dataset_size = tokens_per_sample, dataset_size
        self.on_point, self.deadline = on_point, deadline
        self.points: dict[int, ThroughputPoint] = {}
        self.cut_short = False

    def has_time(self) -> bool:
        """Whether a new size may start; once it may not, ``cut_short`` says so."""
        if self.deadline is None or not self.points or self.prober.clock() < self.deadline:
            return True
        self.cut_short = True
        return False

    def measure(self, batch_size: int) -> ThroughputPoint | None:
        """The point at ``batch_size``, timed now unless it was before; ``None`` if it does not fit or no time is left."""
        if batch_size not in self.points:
            if not self.has_time():
                return None
            trial = self.prober.probe(batch_size)
            if not trial.fits:
                return None
            warm = self.timing_warmup_steps
            self._keep(batch_size, trial.step_seconds[warm:], trial.peak_bytes, trial.optimizer_seconds[warm:])
        return self.points[batch_size]

    def retime(self, batch_size: int, extra_steps: int) -> bool:
        """Time ``batch_size`` again for ``extra_steps`` more timed steps (after the warm-up ones), kept with
        the steps timed before; false when no time was left or it did not fit this time."""
        if not self.has_time():
            return False
        trial = self.prober.probe(batch_size, steps=self.timing_warmup_steps + extra_steps)
        if not trial.fits:
            return False
        before = self.points[batch_size]
        timed = (*before.timed_step_seconds, *trial.step_seconds[self.timing_warmup_steps :])
        optimizer = (*before.timed_optimizer_seconds, *trial.optimizer_seconds[self.timing_warmup_steps :])
        self._keep(batch_size, timed, before.peak_bytes, optimizer)
        return True

    def _keep(
        self, batch_size: int, timed: tuple[float, ...], peak_bytes: int | None, optimizer: tuple[float, ...] = ()
    ) -> None:
        seconds = statistics.median(timed)
        samples = rate(batch_size, seconds)
        tokens = samples * self.tokens_per_sample if self.tokens_per_sample else None
        epoch = math.ceil(self.dataset_size / batch_size) * seconds if self.dataset_size else None
        point = ThroughputPoint(batch_size, seconds, samples, tokens, peak_bytes, epoch, tuple(timed), tuple(optimizer))
        self.points[batch_size] = point
        if self.on_point is not None:
            self.on_point(point)

    def ordered(self) -> list[ThroughputPoint]:
        return sorted(self.points.values(), key=lambda p: p.batch_size)

    def best(self) -> ThroughputPoint:
        return max(self.points.values(), key=lambda p: p.samples_per_second)

    def within(self, tolerance: float) -> list[ThroughputPoint]:
        best = self.best().samples_per_second
        return [p for p in self.ordered() if p.samples_per_second >= (1 - tolerance) * best]

    def within_noise(self) -> list[ThroughputPoint]:
        """The points whose samples/s at the fast end of their spread reach the best's at its slow end."""
        slowest_best = self.best().samples_per_second_low
        return [p for p in self.ordered() if p.samples_per_second_high >= slowest_best]


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


def _suspects(meter: _Meter) -> tuple[list[int], str]:
    """The sizes to time again, and why: all of them where the fitted per-sample cost is negative, else those
    whose range of timed steps (fastest to slowest) overlaps the best's, where that is more than the best alone."""
    points = meter.ordered()
    if len(points) < 2:
        return [], ""
    if _fit_line(points)[1] < 0:
        return [p.batch_size for p in points], "the fitted per-sample cost was negative"
    best = meter.best()
    slowest_best = rate(best.batch_size, max(best.timed_step_seconds, default=best.step_seconds))
    near = [
        p.batch_size
        for p in points
        if rate(p.batch_size, min(p.timed_step_seconds, default=p.step_seconds)) >= slowest_best
    ]
    return (near, "their timed steps overlapped the best's") if len(near) > 1 else ([], "")


def _retime(meter: _Meter, extra_steps: int) -> str | None:
    """Time the suspect sizes again (once), ``extra_steps`` more timed steps each, while time is left; a note
    saying which and why, or ``None`` where none was."""
    sizes, why = _suspects(meter) if extra_steps else ([], "")
    retimed = [size for size in sizes if meter.retime(size, extra_steps)]
    if not retimed:
        return None
    return f"timed {len(retimed)} sizes again ({retimed[0]} to {retimed[-1]}), {extra_steps} more steps each: {why}"


def _falls_beyond_noise(points: list[ThroughputPoint], beta: float) -> bool:
    """Whether the fitted step time falls, from the smallest size to the largest, by more than the widest
    spread (interquartile range) of any size's timed steps: a fall that noise does not explain.

    >>> flat = [ThroughputPoint(b, 0.05, b / 0.05, None, None, timed_step_seconds=(0.04, 0.05, 0.06)) for b in (1, 64)]
    >>> _falls_beyond_noise(flat, -1e-4), _falls_beyond_noise(flat, -1e-3), _falls_beyond_noise(flat, 1e-3)
    (False, True, False)
    """
    noise_seconds = max(p.step_seconds_high - p.step_seconds_low for p in points)
    fall_seconds = -beta * (points[-1].batch_size - points[0].batch_size)
    return fall_seconds > noise_seconds


def _verdict(meter: _Meter, beta: float) -> tuple[bool, str]:
    """Whether the timings tell the sizes apart, and one line saying what they could tell: not where the
    step time falls as the batch grows beyond the timing noise, nor where every size runs within the
    noise of the best."""
    points, best = meter.ordered(), meter.best()
    if len(points) < 2:
        return True, f"only batch size {best.batch_size} was timed: there was nothing to compare it with"
    if beta < 0 and _falls_beyond_noise(points, beta):
        return False, (
            f"the timings cannot rank these sizes on this device: the step time fell as the batch grew "
            f"(fitted {beta * 1000:.3g} ms per sample) beyond the timing noise, which more work per step cannot "
            "do: something other than the batch (warm-up, contention, noise) drives these timings"
        )
    noisy = meter.within_noise()
    best_rate = f"{best.samples_per_second:,.1f} samples/s at {best.batch_size}"
    if len(noisy) == len(points):
        return False, (
            f"the timings cannot tell these sizes apart on this device: every size from {points[0].batch_size} "
            f"to {points[-1].batch_size} runs within the timing noise of the best ({best_rate})"
        )
    return True, (
        f"the timings tell the sizes apart: {len(points) - len(noisy)} of the {len(points)} sizes timed "
        f"run slower than the best ({best_rate}) beyond the timing noise"
    )


def _choose(
    meter: _Meter, tolerance: float, time_budget_seconds: float | None, distinguishable: bool = True
) -> tuple[int, str, list[str]]:
    """The size given, the rule that gave it, and notes: the smallest within ``tolerance`` of the best (where
    the timings cannot tell the sizes apart, the smallest within the timing noise or ``tolerance`` of the
    best); with ``time_budget_seconds``, the smallest whose projected epoch fits it."""
    candidates = meter.within(tolerance)
    reason = f"It is the smallest batch within {tolerance:.0%} of the best throughput."
    if not distinguishable:
        near = {p.batch_size: p for p in [*candidates, *meter.within_noise()]}
        candidates = [near[size] for size in sorted(near)]
        reason = f"It is the smallest batch within the timing noise or {tolerance:.0%} of the best throughput."
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
    on_point: PointCallback | None = None,
    max_seconds: float | None = None,
    extra_timed_steps: int | None = None,
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

    Where the fitted per-sample cost is negative, or other sizes' timed steps overlap the best's, those
    sizes are timed again once, ``extra_timed_steps`` more timed steps each (``None``: twice
    ``timed_steps``; 0: never). If the timings still cannot tell the sizes apart, the result is not
    ``distinguishable``: its ``verdict`` and ``summary()`` say so, and ``batch_size`` is the smallest
    size within the timing noise (or ``tolerance``) of the best. ``on_point(point)`` is called as each
    size is timed, in order (again for a size timed again). ``max_seconds`` (counted on ``clock``, the
    search for the largest size included) starts no new size once passed; the first size always runs,
    the answer comes from what was measured, and ``notes`` and ``stopped_by`` say the limit cut it short.

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
        on_point=on_point,
        max_seconds=max_seconds,
        extra_timed_steps=extra_timed_steps,
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


def check_max_seconds(max_seconds: Any) -> None:
    """A one-line error unless ``max_seconds`` is ``None`` or a positive, finite number of seconds.

    >>> check_max_seconds(float("inf"))
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: max_seconds must be a finite number of seconds, got inf: give the seconds it may take, or None for no limit
    """
    check_seconds(max_seconds)
    if max_seconds is not None and not math.isfinite(max_seconds):
        raise InputError(
            f"max_seconds must be a finite number of seconds, got {max_seconds!r}: give the seconds it may take, or None for no limit"
        )


def _check_noise_options(on_point: Any, extra_timed_steps: Any) -> None:
    if on_point is not None and not callable(on_point):
        raise InputTypeError(f"on_point must be a function of a ThroughputPoint, or None, got {on_point!r}")
    if extra_timed_steps is not None and (
        not isinstance(extra_timed_steps, int) or isinstance(extra_timed_steps, bool) or extra_timed_steps < 0
    ):
        raise InputError(
            f"extra_timed_steps must be a whole number of steps (0: never time again) or None, got {extra_timed_steps!r}"
        )


def _check_also_time(also_time: Any) -> None:
    sizes = list(also_time) if isinstance(also_time, (list, tuple, set, frozenset, range)) else None
    if sizes is None or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
        raise InputError(f"also_time must be a list of positive batch sizes, got {also_time!r}")


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
    on_point: PointCallback | None = None,
    max_seconds: float | None = None,
    extra_timed_steps: int | None = None,
    also_time: Sequence[int] = (),
    **options: Any,
) -> ThroughputResult:
    """``find_optimal_batch_size`` for a ``Workload``: ``settings`` (a ``SearchSettings``) and
    ``options`` (any of its fields, by keyword) say how the maximum is searched and what is kept
    free, as in ``search_workload``. ``max_seconds`` bounds the whole of it, the search for the
    maximum included (a ``settings.max_seconds`` bounds that search alone, as before). ``also_time``
    names sizes to time besides the grid (those above the maximum are skipped), such as the micro-batches
    a plan for a global batch could use."""
    _check(tolerance, safety_fraction, timing_warmup_steps, timed_steps, dataset_size, time_budget_seconds)
    _check_also_time(also_time)
    check_max_seconds(max_seconds)
    _check_noise_options(on_point, extra_timed_steps)
    check_maximum(options.get("max_batch_size"))
    started = clock()
    s = SearchSettings.of(settings, **options)
    dev = resolve_device(device, workload.model)
    maximum, search_stopped = _maximum(workload, s, dev, max_seconds)
    top = max(s.min_batch_size, math.floor(maximum * safety_fraction)) if safety_fraction else maximum
    _capacity, limit = usable_bytes(dev, s.margin)
    steps = timing_warmup_steps + timed_steps
    deadline = started + max_seconds if max_seconds is not None else None
    with _timeline_off(dev), Prober(dev.prepare(workload), dev, steps=steps, limit_bytes=limit, clock=clock) as prober:
        meter = _Meter(prober, timing_warmup_steps, tokens_per_sample, dataset_size, on_point, deadline)
        for size in _grid(s.min_batch_size, top):
            if meter.measure(size) is None:
                break
        for size in sorted(b for b in set(also_time) if s.min_batch_size <= b <= top):
            meter.measure(size)
        if not meter.points:
            raise NoBatchFitsError(
                f"even batch size {s.min_batch_size} does not fit on {dev.name} while timing steps: "
                "free memory or lower the model's",
                [],
            )
        _refine(meter, tolerance, refine_rounds)
        extra = 2 * timed_steps if extra_timed_steps is None else extra_timed_steps
        retimed = _retime(meter, extra)
    notes = [*_limit_notes(meter, max_seconds, maximum, search_stopped), *([retimed] if retimed else [])]
    result = _result(meter, tolerance, time_budget_seconds, maximum, top, safety_fraction, notes)
    result.stopped_by = "max_seconds" if meter.cut_short else search_stopped
    return result


def _maximum(workload: Workload, s: SearchSettings, dev: Any, max_seconds: float | None) -> tuple[int, str | None]:
    """The caller's ``max_batch_size``, else the largest that fits, searched within ``max_seconds`` (and
    the settings' own limit); and what stopped that search early (``"max_seconds"``, ``"max_trials"``), if anything."""
    if s.max_batch_size:
        return s.max_batch_size, None
    if max_seconds is not None:
        s = s.replace(max_seconds=min(max_seconds, s.max_seconds or max_seconds))
    found = search_workload(workload, s, device=dev)
    return found.batch_size, getattr(found, "extra", {}).get("stopped_by")


def _limit_notes(meter: _Meter, max_seconds: float | None, maximum: int, search_stopped: str | None) -> list[str]:
    """Notes where a limit stopped the search for the largest size early, or cut the timing short."""
    notes = []
    if search_stopped is not None:
        notes.append(
            f"the search for the largest batch stopped early ({search_stopped}) at {maximum}: the grid stops there"
        )
    if meter.cut_short:
        points = meter.ordered()
        notes.append(
            f"the {max_seconds:g} s limit (max_seconds) cut the timing short after {len(points)} sizes "
            f"({points[0].batch_size} to {points[-1].batch_size}): the answer is from those"
        )
    return notes


def _result(
    meter: _Meter,
    tolerance: float,
    time_budget_seconds: float | None,
    maximum: int,
    top: int,
    safety_fraction: float | None,
    notes: list[str] | None = None,
) -> ThroughputResult:
    points = meter.ordered()
    alpha, beta = _fit_line(points)
    distinguishable, verdict = _verdict(meter, beta)
    chosen, reason, choice_notes = _choose(meter, tolerance, time_budget_seconds, distinguishable)
    best = meter.best().batch_size
    largest = meter.points.get(top)
    saved = largest.peak_bytes - meter.points[chosen].peak_bytes if largest and largest.peak_bytes is not None else None
    notes = [*choice_notes, *(notes or [])]
    if beta < 0:
        notes.append(
            f"the fitted per-sample cost is negative ({beta * 1000:.3g} ms per sample): the step time did not "
            "grow with the batch, so the fit t(B) = alpha + beta*B has no knee (and says nothing of a fixed cost)"
        )
    if safety_fraction:
        notes.append(f"kept below {safety_fraction:.0%} of the maximum ({maximum}): at most {top}")
    return ThroughputResult(
        chosen, best, maximum, tolerance, points, alpha, beta, reason, saved, notes, distinguishable, verdict
    )
