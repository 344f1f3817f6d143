"""What a throughput search returns: each batch size's measured step time and rates (``ThroughputPoint``), and
the chosen batch with every point, the fitted t(B) = alpha + beta*B and its knees (``ThroughputResult``)."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.devices.units import format_bytes


@dataclass(frozen=True)
class ThroughputPoint:
    """One batch size: median steady-state step time, samples/s, tokens/s, and peak memory."""

    batch_size: int
    step_seconds: float
    samples_per_second: float
    tokens_per_second: float | None
    peak_bytes: int | None
    epoch_seconds: float | None = None


@dataclass
class ThroughputResult:
    """The chosen batch (smallest within ``tolerance`` of the best throughput), every point
    measured, the fitted t(B) = alpha + beta*B and its knees, and the memory saved."""

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

    @property
    def max_batch_size(self) -> int:
        """Deprecated: ``largest_batch_size`` (``max_batch_size`` is the caller's cap everywhere else)."""
        warnings.warn("ThroughputResult.max_batch_size is now largest_batch_size", DeprecationWarning, stacklevel=2)
        return self.largest_batch_size

    def knee(self, fraction: float) -> float | None:
        """The batch at which the fitted throughput reaches ``fraction`` of its ceiling."""
        if self.beta_seconds_per_sample <= 0 or self.alpha_seconds <= 0:
            return None
        return fraction / (1 - fraction) * self.alpha_seconds / self.beta_seconds_per_sample

    def point(self, batch_size: int) -> ThroughputPoint:
        """The point measured at ``batch_size`` (``StopIteration`` if it was not measured)."""
        return next(p for p in self.points if p.batch_size == batch_size)

    def summary(self) -> str:
        """One sentence: the batch to use, its throughput against the best, and the memory it saves."""
        chosen, best = self.point(self.batch_size), self.point(self.best_batch_size)
        saved = (
            f", {format_bytes(self.memory_saved_bytes)} less memory than the maximum" if self.memory_saved_bytes else ""
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
            "memory_saved_bytes": self.memory_saved_bytes,
            "reason": self.reason,
            "notes": list(self.notes),
            "points": [asdict(p) for p in self.points],
        }
