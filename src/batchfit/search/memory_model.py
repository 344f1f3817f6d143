"""MemoryModel: peak bytes against batch size B, fitted from trials, to jump to the edge.

The live bytes after any one op of a step are a line in B (each tensor either scales with the
batch or does not), so the peak is the maximum of one line per op. Two trials whose op
sequences match give every line, kinks included: at small B the backward peak may be set by
gradients and at large B by activations, which no single line through small trials sees. Where
a device records no per-op timeline, one line per phase (forward, backward, optimizer) stands
in; with a single trial, a conservative line treats everything above the held state as
growing with the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchfit.search.trial import Trial


def _least_squares_slope(points: Sequence[tuple[int, int]]) -> float:
    sizes = np.array([b for b, _ in points], dtype=float)
    peaks = np.array([p for _, p in points], dtype=float)
    centred = sizes - sizes.mean()
    return float((centred * (peaks - peaks.mean())).sum() / (centred**2).sum())


@dataclass(frozen=True)
class MemoryModel:
    """Lines ``bytes(B) = anchor_bytes + slope_bytes * (B - anchor_batch_size)``; the peak is their max.

    >>> trials = [Trial(1, True, 110, 0.1, phase_peak_bytes={"backward": 110}),
    ...           Trial(3, True, 130, 0.1, phase_peak_bytes={"backward": 130})]
    >>> model = MemoryModel.fit(trials)
    >>> model.kind, model.max_batch_size(200)
    ('phases', 10)
    """

    anchor_batch_size: int
    anchor_bytes: np.ndarray
    slope_bytes: np.ndarray
    kind: str

    @classmethod
    def fit(cls, trials: Sequence[Trial]) -> MemoryModel | None:
        """The model through the largest fitting trial, or ``None`` when nothing fitted."""
        fitted = sorted((t for t in trials if t.fits and t.phase_peak_bytes), key=lambda t: t.batch_size)
        if not fitted:
            return None
        return cls._from_timelines(fitted) or cls._from_phases(fitted)

    @classmethod
    def _from_timelines(cls, fitted: list[Trial]) -> MemoryModel | None:
        anchor = fitted[-1]
        if anchor.timeline is None:
            return None
        partners = [t for t in fitted[:-1] if t.timeline is not None and len(t.timeline) == len(anchor.timeline)]
        if not partners:
            return None
        partner = partners[0]  # the farthest from the anchor: rounding noise matters least
        # Slopes from the unrounded bytes where the device has them: rounding to blocks can hide
        # a small tensor's growth between two small batches entirely.
        exact = anchor.exact_timeline is not None and partner.exact_timeline is not None
        top, bottom = (anchor.exact_timeline, partner.exact_timeline) if exact else (anchor.timeline, partner.timeline)
        slopes = (np.asarray(top, dtype=float) - np.asarray(bottom, dtype=float)) / (
            anchor.batch_size - partner.batch_size
        )
        return cls(anchor.batch_size, np.asarray(anchor.timeline, dtype=float), slopes, "timeline")

    @classmethod
    def _from_phases(cls, fitted: list[Trial]) -> MemoryModel:
        anchor = fitted[-1]
        tops, slopes = [], []
        for phase, top in anchor.phase_peak_bytes.items():
            points = [(t.batch_size, t.phase_peak_bytes[phase]) for t in fitted if phase in t.phase_peak_bytes]
            if len(points) >= 2:
                slopes.append(_least_squares_slope(points))
            else:
                slopes.append((top - (anchor.held_bytes or 0)) / anchor.batch_size)
            tops.append(top)
        kind = "phases" if len(fitted) >= 2 else "conservative"
        return cls(anchor.batch_size, np.array(tops, dtype=float), np.array(slopes, dtype=float), kind)

    def predict_peak_bytes(self, batch_size: int) -> float:
        """The predicted peak at ``batch_size``."""
        return float((self.anchor_bytes + self.slope_bytes * (batch_size - self.anchor_batch_size)).max())

    def max_batch_size(self, limit_bytes: int) -> int | None:
        """The largest batch whose predicted peak stays within ``limit_bytes`` (``None``: no line rises)."""
        rising = self.slope_bytes > 0
        if not rising.any():
            return None
        room = (limit_bytes - self.anchor_bytes[rising]) / self.slope_bytes[rising]
        return self.anchor_batch_size + int(np.floor(room.min()))
