"""Predict a configuration's largest batch from the configurations already measured.

Every measured configuration gives two numbers: the bytes held before any batch (``held_bytes``:
parameters, buffers, optimizer state) and the bytes each sample adds at the edge
(``(peak_bytes - held_bytes) / batch_size``). Memory in the usual knobs (sequence length, crops,
top-k, active blocks, width) is close to a power law over a modest range, so both are fitted as
``log y = c0 + sum_i c_i log knob_i`` by least squares over the knobs that vary among the measured
configurations; the largest batch is then ``(limit_bytes - held_bytes) / per_sample_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class MeasuredConfig:
    """One configuration's knobs and its memory at the edge."""

    knobs: Mapping[str, Any]
    batch_size: int
    peak_bytes: int
    held_bytes: int

    @property
    def per_sample_bytes(self) -> float:
        return max(self.peak_bytes - self.held_bytes, 1) / self.batch_size


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class CrossConfigModel:
    """Power laws in the varying knobs for held and per-sample bytes.

    >>> points = [MeasuredConfig({"seq_len": s}, 1000 // s, 100 + 1000 // s * s, 100) for s in (10, 20, 40)]
    >>> CrossConfigModel.fit(points).predict_batch_size({"seq_len": 25}, 1100)
    40
    """

    knobs: tuple[str, ...]
    fixed: Mapping[str, Any]
    held_coefficients: np.ndarray
    per_sample_coefficients: np.ndarray
    points: int

    @classmethod
    def fit(cls, measured: Sequence[MeasuredConfig]) -> CrossConfigModel | None:
        """The model, or ``None`` with fewer than two points or more knobs varying than points allow."""
        if len(measured) < 2:
            return None
        names = list(measured[0].knobs)
        varying = tuple(k for k in names if len({repr(m.knobs.get(k)) for m in measured}) > 1)
        fixed = {k: measured[0].knobs.get(k) for k in names if k not in varying}
        if len(measured) < len(varying) + 1 or not all(_numeric(m.knobs.get(k)) for m in measured for k in varying):
            return None
        features = np.array([[1.0, *(math.log(m.knobs[k]) for k in varying)] for m in measured])
        held = np.log([max(m.held_bytes, 1) for m in measured])
        per_sample = np.log([m.per_sample_bytes for m in measured])
        solve = lambda y: np.linalg.lstsq(features, y, rcond=None)[0]  # noqa: E731
        return cls(varying, fixed, solve(held), solve(per_sample), len(measured))

    def covers(self, knobs: Mapping[str, Any]) -> bool:
        """True when every knob is either fitted (and numeric) or at the value all points shared."""
        fitted = all(_numeric(knobs.get(k)) for k in self.knobs)
        return fitted and all(repr(knobs.get(k)) == repr(v) for k, v in self.fixed.items())

    def predict_batch_size(self, knobs: Mapping[str, Any], limit_bytes: int) -> int | None:
        """The predicted largest batch for ``knobs`` under ``limit_bytes``, or ``None`` when the
        knobs are outside what was fitted."""
        if not self.covers(knobs):
            return None
        row = np.array([1.0, *(math.log(knobs[k]) for k in self.knobs)])
        held = math.exp(float(row @ self.held_coefficients))
        per_sample = math.exp(float(row @ self.per_sample_coefficients))
        return max(1, math.floor((limit_bytes - held) / per_sample))
