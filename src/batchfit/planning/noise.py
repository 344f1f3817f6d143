"""The gradient noise scale and the critical batch size (McCandlish et al. 2018, "An Empirical Model
of Large-Batch Training", arXiv:1812.06162), and Pollux's statistical efficiency (Qiao et al. 2021).

With G the true gradient and Σ the per-example gradient covariance, a batch of B examples has
``E|G_B|² = |G|² + tr(Σ)/B``. Two batch sizes per step give unbiased estimates of both (appendix
A.1), each kept as its own average over steps; only the averages are divided, because the mean
of per-step ratios is biased high. The simple noise scale ``B_simple = tr(Σ)/|G|²`` approximates
the critical batch: training at B takes ``S = S_min (1 + B_noise/B)`` steps and
``E = E_min (1 + B/B_noise)`` samples, the tradeoff ``(S/S_min - 1)(E/E_min - 1) = 1`` (eq. 2.11).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchfit.errors import InputError
from batchfit.errors import InputTypeError

BOOTSTRAP_SAMPLES = 400


def two_batch_estimates(small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> tuple[float, float]:
    """Unbiased ``(|G|², tr Σ)`` from the mean squared gradient norm at two batch sizes (appendix A.1).

    >>> two_batch_estimates(small_sq=3.0, small_batch=2, big_sq=1.5, big_batch=8)
    (1.0, 4.0)
    """
    if not big_batch > small_batch > 0:
        raise InputError(f"the big batch must be larger than the small one, got {small_batch=} and {big_batch=}")
    grad_norm_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace_sigma = (small_sq - big_sq) / (1 / small_batch - 1 / big_batch)
    return grad_norm_sq, trace_sigma


@dataclass(frozen=True)
class NoiseScale:
    """A measured noise scale: ``b_simple = trace_sigma / grad_norm_sq``, its bootstrap standard
    error over steps, and the 16th-84th percentile range it implies for the critical batch.

    >>> noise = NoiseScale(b_simple=256.0, b_simple_stderr=20.0, grad_norm_sq=1.0, trace_sigma=256.0,
    ...                    steps=50, small_batch_size=8, big_batch_size=64, critical_range=(236.0, 277.0))
    >>> noise.steps_ratio(256), noise.samples_ratio(256)
    (2.0, 2.0)
    """

    b_simple: float
    b_simple_stderr: float
    grad_norm_sq: float
    trace_sigma: float
    steps: int
    small_batch_size: float
    big_batch_size: float
    critical_range: tuple[float, float]

    def steps_ratio(self, batch_size: float) -> float:
        """``S/S_min = 1 + B_noise/B``: optimizer steps needed at ``batch_size`` relative to the fewest."""
        return 1 + self.b_simple / batch_size

    def samples_ratio(self, batch_size: float) -> float:
        """``E/E_min = 1 + B/B_noise``: samples needed at ``batch_size`` relative to the fewest."""
        return 1 + batch_size / self.b_simple

    def efficiency(self, batch_size: float, base_batch_size: float) -> float:
        """Pollux's statistical efficiency of ``batch_size`` relative to ``base_batch_size``:
        ``(φ + M0)/(φ + M)``, the progress per sample compared with the base batch."""
        return statistical_efficiency(batch_size, base_batch_size, self.b_simple)

    def tradeoff(self, batch_sizes: Sequence[int]) -> list[dict[str, float]]:
        """Steps and samples relative to their minimum, per batch size."""
        return [
            {"batch_size": b, "steps_ratio": self.steps_ratio(b), "samples_ratio": self.samples_ratio(b)}
            for b in batch_sizes
        ]

    def summary(self) -> str:
        """One sentence: B_simple with its error, the critical batch range, and what it means."""
        low, high = self.critical_range
        return (
            f"Gradient noise scale B_simple = {self.b_simple:,.1f} ± {self.b_simple_stderr:,.1f} over {self.steps} steps "
            f"(critical batch about {low:,.0f}-{high:,.0f}): there, training takes ~2x the fewest steps and ~2x the "
            "fewest samples; smaller batches save samples, larger ones save steps."
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``critical_range`` as a list)."""
        return {
            "b_simple": self.b_simple,
            "b_simple_stderr": self.b_simple_stderr,
            "grad_norm_sq": self.grad_norm_sq,
            "trace_sigma": self.trace_sigma,
            "steps": self.steps,
            "small_batch_size": self.small_batch_size,
            "big_batch_size": self.big_batch_size,
            "critical_range": list(self.critical_range),
        }


def statistical_efficiency(batch_size: float, base_batch_size: float, noise_scale: float) -> float:
    """Pollux (Qiao et al. 2021, OSDI): ``(φ + M0)/(φ + M)`` with φ the gradient noise scale.

    >>> statistical_efficiency(64, 32, 32.0)
    0.6666666666666666
    """
    return (noise_scale + base_batch_size) / (noise_scale + batch_size)


class NoiseScaleEstimator:
    """Feed ``update(small_sq, small_batch, big_sq, big_batch)`` once per step; ``result()`` divides
    the averages. ``ema_decay=None`` averages every step alike (a measurement at a fixed point);
    a decay such as 0.99 follows a model that trains (bias-corrected, as in Adam).

    >>> estimator = NoiseScaleEstimator()
    >>> for _ in range(3):
    ...     estimator.update(3.0, 2, 1.5, 8)
    >>> estimator.result().b_simple
    4.0
    """

    def __init__(self, ema_decay: float | None = None):
        if ema_decay is not None and not 0 < ema_decay < 1:
            raise InputError(f"ema_decay must be in (0, 1) or None (a plain average), got {ema_decay!r}")
        self.ema_decay = ema_decay
        self.grad_norm_sq: list[float] = []
        self.trace_sigma: list[float] = []
        self.sizes: tuple[float, float] = (0.0, 0.0)

    def update(self, small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> None:
        grad_norm_sq, trace_sigma = two_batch_estimates(small_sq, small_batch, big_sq, big_batch)
        self.grad_norm_sq.append(grad_norm_sq)
        self.trace_sigma.append(trace_sigma)
        self.sizes = (small_batch, big_batch)

    def _weights(self) -> np.ndarray:
        steps = len(self.grad_norm_sq)
        if self.ema_decay is None:
            return np.ones(steps)
        return (1 - self.ema_decay) * self.ema_decay ** np.arange(steps - 1, -1, -1)

    def result(self) -> NoiseScale:
        """The noise scale from the averages, with a bootstrap over steps for its uncertainty."""
        steps = len(self.grad_norm_sq)
        if steps < 2:
            raise InputError(f"the noise scale needs at least 2 steps, got {steps}: measure for more steps")
        weights = self._weights()
        g, s = np.array(self.grad_norm_sq), np.array(self.trace_sigma)
        grad_norm_sq, trace_sigma = float(weights @ g / weights.sum()), float(weights @ s / weights.sum())
        if grad_norm_sq <= 0 or trace_sigma <= 0:
            raise InputError(
                f"the gradient signal is below the noise here (|G|² ≈ {grad_norm_sq:.3g}, tr Σ ≈ {trace_sigma:.3g}): "
                "measure for more steps or with a larger big batch"
            )
        picks = np.random.default_rng(0).integers(0, steps, size=(BOOTSTRAP_SAMPLES, steps))
        ratios = (weights[picks] * s[picks]).sum(1) / (weights[picks] * g[picks]).sum(1)
        ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
        b_simple = trace_sigma / grad_norm_sq
        low, high = np.percentile(ratios, [16, 84]) if ratios.size else (math.nan, math.nan)
        stderr = float(ratios.std()) if ratios.size else math.nan
        return NoiseScale(b_simple, stderr, grad_norm_sq, trace_sigma, steps, *self.sizes, (float(low), float(high)))


def goodput_optimal_batch(
    alpha_seconds: float, beta_seconds_per_sample: float, noise_scale: float, max_batch_size: int
) -> int:
    """The batch in ``[1, max_batch_size]`` with the most goodput for step time ``alpha + beta*B``:
    throughput ``B/(alpha + beta*B)`` times efficiency ``1/(φ + B)`` peaks at ``sqrt(φ*alpha/beta)``.

    >>> goodput_optimal_batch(0.1, 0.001, 400.0, 4096)
    200
    """
    if beta_seconds_per_sample <= 0:
        return max_batch_size  # no per-sample cost measured: goodput keeps rising with the batch
    best = math.sqrt(noise_scale * max(alpha_seconds, 0.0) / beta_seconds_per_sample)
    candidates = {min(max(int(c), 1), max_batch_size) for c in (math.floor(best), math.ceil(best))}

    def goodput(b: int) -> float:
        return b / ((alpha_seconds + beta_seconds_per_sample * b) * (noise_scale + b))

    return max(sorted(candidates), key=goodput)


MAX_ACCUMULATION_STEPS = 256  # the most accumulation a "critical" plan will ask for


def critical_target(noise_scale: float, micro_batch_size: int, devices: int) -> tuple[int, list[str]]:
    """The global batch nearest the noise scale that the devices reach exactly: a multiple of
    ``micro_batch_size * devices`` (or of ``devices`` below one micro-batch each), at most
    ``MAX_ACCUMULATION_STEPS`` accumulation steps. Returns it and notes on any clamping.

    >>> critical_target(300.0, 16, 2)
    (288, [])
    """
    check_noise_scale(noise_scale)
    unit = micro_batch_size * devices
    most = unit * MAX_ACCUMULATION_STEPS
    if noise_scale > most:
        return most, [
            f"the critical batch (~{noise_scale:,.0f}) needs more than {MAX_ACCUMULATION_STEPS} accumulation "
            f"steps on {devices} device(s): capped at {most}; add devices to go higher"
        ]
    if noise_scale >= unit:
        return max(unit, round(noise_scale / unit) * unit), []
    return max(devices, round(noise_scale / devices) * devices), []


def tradeoff_at(noise_scale: float, batch_size: int) -> dict[str, float]:
    """McCandlish's tradeoff at ``batch_size``: steps and samples relative to their minimum."""
    return {
        "b_simple": noise_scale,
        "batch_size": batch_size,
        "steps_ratio": 1 + noise_scale / batch_size,
        "samples_ratio": 1 + batch_size / noise_scale,
    }


@dataclass(frozen=True)
class Goodput:
    """Throughput times statistical efficiency per measured batch, the best measured batch, and
    the optimum of the fitted step-time line (``sqrt(φ*alpha/beta)``, clamped to what fits)."""

    noise_scale: float
    base_batch_size: int
    points: list[dict[str, float]]
    best_measured_batch_size: int
    optimal_batch_size: int

    def summary(self) -> str:
        """One sentence: where goodput is best, measured and on the fitted line."""
        return (
            f"With a gradient noise scale of {self.noise_scale:,.0f}, goodput (throughput x statistical efficiency, "
            f"Pollux) is best at batch {self.best_measured_batch_size} of those measured; the fitted line "
            f"peaks at {self.optimal_batch_size} (sqrt(B_simple x alpha / beta))."
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the noise scale, the base batch, every point and both optima."""
        return {
            "noise_scale": self.noise_scale,
            "base_batch_size": self.base_batch_size,
            "points": self.points,
            "best_measured_batch_size": self.best_measured_batch_size,
            "optimal_batch_size": self.optimal_batch_size,
        }


def check_noise_scale(noise_scale: Any) -> float:
    """``noise_scale`` (B_simple, in samples) when it is a finite positive number; else one line naming the fix.

    >>> check_noise_scale(512)
    512.0
    >>> check_noise_scale(float("nan"))
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: the noise scale must be a positive number of samples (batchfit critical measures it), got nan
    """
    if isinstance(noise_scale, bool) or not isinstance(noise_scale, (int, float)):
        raise InputTypeError(f"the noise scale must be a number of samples such as 512, got {noise_scale!r}")
    if not math.isfinite(noise_scale) or noise_scale <= 0:
        raise InputError(
            f"the noise scale must be a positive number of samples (batchfit critical measures it), got {noise_scale!r}"
        )
    return float(noise_scale)


def goodput(throughput: Any, noise_scale: float, base_batch_size: int | None = None) -> Goodput:
    """Pollux's goodput over a ``ThroughputResult``: samples/s times ``(φ + M0)/(φ + M)``; ``M0``
    defaults to the smallest batch measured."""
    check_noise_scale(noise_scale)
    base = base_batch_size or min(p.batch_size for p in throughput.points)
    points = [
        {
            "batch_size": p.batch_size,
            "samples_per_second": p.samples_per_second,
            "efficiency": statistical_efficiency(p.batch_size, base, noise_scale),
            "goodput": p.samples_per_second * statistical_efficiency(p.batch_size, base, noise_scale),
        }
        for p in throughput.points
    ]
    best = max(points, key=lambda point: point["goodput"])
    optimal = goodput_optimal_batch(
        throughput.alpha_seconds, throughput.beta_seconds_per_sample, noise_scale, throughput.largest_batch_size
    )
    return Goodput(noise_scale, base, points, int(best["batch_size"]), optimal)


def noise_scale_value(noise_scale: Any) -> float | None:
    """B_simple from a ``NoiseScale`` or a number (``None`` stays ``None``)."""
    if noise_scale is None:
        return None
    value = getattr(noise_scale, "b_simple", noise_scale)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"noise_scale must be a NoiseScale or a positive B_simple, got {noise_scale!r}")
    return float(value)


def tradeoff_advice(critical: dict[str, float]) -> str:
    """One sentence on what ``tradeoff_at`` found, for a plan's advice."""
    return (
        f"With a gradient noise scale of {critical['b_simple']:,.0f}, a global batch of {critical['batch_size']:,} "
        f"takes {critical['steps_ratio']:.2f}x the fewest optimizer steps and {critical['samples_ratio']:.2f}x the "
        "fewest samples (McCandlish et al. 2018: at the critical batch both are about 2x)"
    )
