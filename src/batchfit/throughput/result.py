"""What a throughput search returns: each batch size's measured step time and rates (``ThroughputPoint``), and
the chosen batch with every point, the fitted t(B) = alpha + beta*B and its knees, and whether the timings
could tell the sizes apart at all (``ThroughputResult``)."""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.devices.units import format_bytes


def rate(batch_size: int, seconds: float) -> float:
    """Samples per second of a step of ``batch_size`` samples taking ``seconds`` (infinite at 0 s).

    >>> rate(8, 0.5), rate(8, 0.0)
    (16.0, inf)
    """
    return batch_size / seconds if seconds > 0 else math.inf


@dataclass(frozen=True)
class ThroughputPoint:
    """One batch size: median steady-state step time, samples/s, tokens/s, and peak memory.

    ``timed_step_seconds`` holds every timed step (warm-up steps excluded; a size timed again keeps
    them all), and its spread says how noisy the timing was: ``step_seconds_low`` and
    ``step_seconds_high`` are the first and third quartiles, ``samples_per_second_low`` and
    ``samples_per_second_high`` the rates at those step times (all equal to the median's when fewer
    than two steps were timed).

    >>> point = ThroughputPoint(4, 0.2, 20.0, None, None, timed_step_seconds=(0.1, 0.2, 0.2, 0.3, 0.4))
    >>> point.step_seconds_low, point.step_seconds_high, point.samples_per_second_low
    (0.2, 0.3, 13.333333333333334)
    """

    batch_size: int
    step_seconds: float
    samples_per_second: float
    tokens_per_second: float | None
    peak_bytes: int | None
    epoch_seconds: float | None = None
    timed_step_seconds: tuple[float, ...] = ()
    timed_optimizer_seconds: tuple[float, ...] = ()
    """The optimizer step's own seconds within each timed step (``Trial.optimizer_seconds``)."""

    @property
    def optimizer_seconds(self) -> float | None:
        """The median optimizer step (``None`` where it was not timed): what a later micro-batch of an
        accumulation window does not run."""
        return statistics.median(self.timed_optimizer_seconds) if self.timed_optimizer_seconds else None

    def _quartiles(self) -> tuple[float, float]:
        timed = self.timed_step_seconds
        if len(timed) < 2:
            return self.step_seconds, self.step_seconds
        low, _median, high = statistics.quantiles(timed, n=4, method="inclusive")
        return low, high

    @property
    def step_seconds_low(self) -> float:
        """The first quartile of the timed steps' seconds."""
        return self._quartiles()[0]

    @property
    def step_seconds_high(self) -> float:
        """The third quartile of the timed steps' seconds."""
        return self._quartiles()[1]

    @property
    def samples_per_second_low(self) -> float:
        """Samples/s at the slow end of the spread (``step_seconds_high``)."""
        return rate(self.batch_size, self.step_seconds_high)

    @property
    def samples_per_second_high(self) -> float:
        """Samples/s at the fast end of the spread (``step_seconds_low``)."""
        return rate(self.batch_size, self.step_seconds_low)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the fields and the spread."""
        return {
            **asdict(self),
            "timed_step_seconds": list(self.timed_step_seconds),
            "step_seconds_low": self.step_seconds_low,
            "step_seconds_high": self.step_seconds_high,
            "samples_per_second_low": _finite(self.samples_per_second_low),
            "samples_per_second_high": _finite(self.samples_per_second_high),
        }


def _finite(value: float) -> float | None:
    """``value``, or ``None`` where it is infinite (JSON has no infinity)."""
    return value if math.isfinite(value) else None


@dataclass
class ThroughputResult:
    """The chosen batch (smallest within ``tolerance`` of the best throughput), every point
    measured, the fitted t(B) = alpha + beta*B and its knees, and the memory saved.

    ``distinguishable`` is false when the timings cannot tell the sizes apart: every size ran within
    the timing noise of the best, or the step time fell as the batch grew (a negative fitted
    ``beta_seconds_per_sample``); ``batch_size`` is then the smallest size within that noise (or
    ``tolerance``) of the best, and ``summary()`` says so instead of naming a clear winner.
    ``verdict`` is one line on what the timings could tell; ``stopped_by`` is ``"max_seconds"`` when the
    time limit cut the search or the timing short (``notes`` says where), ``"max_trials"`` when the search's
    trial limit stopped it.

    >>> points = [ThroughputPoint(b, 0.1 * b, 10.0, None, None) for b in (1, 2, 4)]
    >>> result = ThroughputResult(1, 4, 4, 0.05, points, 0.01, 0.1, "It is the smallest batch.", distinguishable=False,
    ...                           verdict="the timings cannot tell these sizes apart on this device")
    >>> result.summary()
    'The timings cannot tell these sizes apart on this device. Batch size 1 is given (10.0 samples/s): it is the smallest batch.'
    >>> result.knee(0.9), result.no_knee_reason
    (None, "the timings cannot tell the sizes apart: a knee of the fitted line would be the noise's")
    """

    batch_size: int
    best_batch_size: int
    largest_batch_size: int
    """The maximum the grid was built under: the caller's ``max_batch_size``, else the largest that fits,
    searched first (with ``safety_fraction`` the grid stops below it; ``notes`` says where)."""
    tolerance: float
    points: list[ThroughputPoint]
    alpha_seconds: float
    beta_seconds_per_sample: float
    reason: str
    memory_saved_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    distinguishable: bool = True
    """Whether the timings tell the sizes apart (see the class docstring)."""
    verdict: str = ""
    """One line on what the timings could tell, e.g. that every size ran within the noise of the best."""
    stopped_by: str | None = None
    """``"max_seconds"`` when the time limit cut the search for the largest size or the timing short
    (``"max_trials"`` when the trial limit stopped that search); ``None`` when nothing did."""

    @property
    def max_batch_size(self) -> int:
        """Deprecated: ``largest_batch_size`` (``max_batch_size`` is the caller's cap everywhere else)."""
        warnings.warn("ThroughputResult.max_batch_size is now largest_batch_size", DeprecationWarning, stacklevel=2)
        return self.largest_batch_size

    def knee(self, fraction: float) -> float | None:
        """The batch at which the fitted throughput reaches ``fraction`` of its ceiling; ``None`` where the
        fit has no knee (``no_knee_reason`` says why)."""
        if self.no_knee_reason is not None:
            return None
        return fraction / (1 - fraction) * self.alpha_seconds / self.beta_seconds_per_sample

    @property
    def no_knee_reason(self) -> str | None:
        """Why the fit has no knee, or ``None`` where it has one: a negative per-sample cost (the step got
        faster as the batch grew), none, no fixed cost, or timings that cannot tell the sizes apart (the
        fit's knee would be the noise's)."""
        if self.beta_seconds_per_sample < 0:
            beta_ms = self.beta_seconds_per_sample * 1000
            return f"the fitted per-sample cost is negative ({beta_ms:.3g} ms per sample): the step time did not grow with the batch"
        if self.beta_seconds_per_sample == 0:
            return "no per-sample cost measured: the step time did not grow with the batch"
        if self.alpha_seconds <= 0:
            return "no fixed cost measured: the fitted step time has no part that a larger batch would amortise"
        if not self.distinguishable:
            return "the timings cannot tell the sizes apart: a knee of the fitted line would be the noise's"
        return None

    def point(self, batch_size: int) -> ThroughputPoint:
        """The point measured at ``batch_size`` (``StopIteration`` if it was not measured)."""
        return next(p for p in self.points if p.batch_size == batch_size)

    def summary(self) -> str:
        """One sentence: the batch to use, its throughput against the best, and the memory it saves; where the
        timings cannot tell the sizes apart, the verdict first and the size given, with the rule that gave it."""
        chosen, best = self.point(self.batch_size), self.point(self.best_batch_size)
        saved = (
            f", {format_bytes(self.memory_saved_bytes)} less memory than the maximum" if self.memory_saved_bytes else ""
        )
        if not self.distinguishable:
            verdict = self.verdict or "the timings cannot tell these sizes apart on this device"
            return (
                f"{verdict[0].upper()}{verdict[1:]}. Batch size {self.batch_size} is given "
                f"({chosen.samples_per_second:,.1f} samples/s{saved}): {self.reason[:1].lower()}{self.reason[1:]}"
            )
        return (
            f"Use batch size {self.batch_size}: {chosen.samples_per_second:,.1f} samples/s, "
            f"{chosen.samples_per_second / best.samples_per_second:.0%} of the best ({best.samples_per_second:,.1f} at "
            f"{self.best_batch_size}){saved}. {self.reason}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the choice, the fit and its knees, the notes and every point."""
        return {
            "batch_size": self.batch_size,
            "best_batch_size": self.best_batch_size,
            "largest_batch_size": self.largest_batch_size,
            "tolerance": self.tolerance,
            "alpha_seconds": self.alpha_seconds,
            "beta_seconds_per_sample": self.beta_seconds_per_sample,
            "knee_90": self.knee(0.90),
            "knee_95": self.knee(0.95),
            "no_knee_reason": self.no_knee_reason,
            "memory_saved_bytes": self.memory_saved_bytes,
            "reason": self.reason,
            "distinguishable": self.distinguishable,
            "verdict": self.verdict,
            "stopped_by": self.stopped_by,
            "notes": list(self.notes),
            "points": [p.to_dict() for p in self.points],
        }
