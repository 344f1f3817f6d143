"""What a plan knows beyond arithmetic: reference batches, starting ranges, regularisation hints,
batch-size ramps and worker shares.

Every piece of advice says where it comes from (a paper, or a rule of thumb); nothing here changes a
plan by itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchfit.errors import InputError

# Typical global batches (common small-scale settings; LLaMA from Touvron et al. 2023, ImageNet from
# Goyal et al. 2017): unit, size, and a learning rate where known.
REFERENCE_BATCHES: dict[str, dict[str, object]] = {
    "gpt2": {"unit": "tokens", "global_batch": 32_768, "range": "32K-64K tokens", "source": "a typical GPT-2 124M run"},
    "bert": {
        "unit": "tokens",
        "global_batch": 262_144,
        "range": "256K tokens",
        "source": "a typical BERT-base (110M) run",
    },
    "llama": {
        "unit": "tokens",
        "global_batch": 4_194_304,
        "range": "4M tokens",
        "source": "Touvron et al. 2023 (LLaMA 7B)",
    },
    "resnet50-imagenet": {
        "unit": "samples",
        "global_batch": 256,
        "learning_rate": 0.1,
        "range": "256 images at lr 0.1",
        "source": "Goyal et al. 2017",
    },
}


def reference(family: str) -> dict[str, object]:
    key = family.strip().lower()
    if key not in REFERENCE_BATCHES:
        raise InputError(f"unknown model family {family!r}: choose one of {', '.join(REFERENCE_BATCHES)}")
    return REFERENCE_BATCHES[key]


def starting_range(capacity_gib: float) -> tuple[int, int]:
    """A rule of thumb for where to start: a batch range by device memory (GiB), to be measured from there."""
    if capacity_gib < 8:
        return 16, 32
    if capacity_gib < 16:
        return 32, 64
    if capacity_gib < 24:
        return 64, 128
    return 128, 256


def regularization_advice(scale: float, weight_decay: float | None = None) -> list[str]:
    """Regularisation hints for a batch ``scale`` times the tuned one, as heuristics: never applied, only reported.

    A larger batch adds less gradient noise, which regularises less; label smoothing, dropout and a
    weight decay scaled by the square root of the batch ratio make up some of it."""
    if scale <= 1:
        return []
    advice = [f"batch {scale:g}x the tuned one: consider label smoothing (0.1) and keeping dropout (a heuristic)"]
    if weight_decay is not None:
        advice.insert(
            0,
            f"weight decay {weight_decay:g} -> {weight_decay * math.sqrt(scale):.3g} (scaled by sqrt of the batch ratio; a heuristic)",
        )
    return advice


def workload_distribution(throughput: dict[str, float], global_batch: int) -> dict[str, dict[str, float]]:
    """Hardware calibration for workers of different speeds: shares proportional to measured
    throughput, and each worker's whole number of samples (largest remainder, so they sum to
    ``global_batch``); the ``hardware_calibration`` block of a training coordinator's batch
    configuration."""
    if not throughput or any(value <= 0 for value in throughput.values()):
        raise InputError("worker throughput must be positive samples/s for every worker, e.g. {'worker-0': 850.0}")
    total = sum(throughput.values())
    shares = {name: value / total for name, value in throughput.items()}
    exact = {name: share * global_batch for name, share in shares.items()}
    samples = {name: math.floor(value) for name, value in exact.items()}
    for name in sorted(exact, key=lambda n: exact[n] - samples[n], reverse=True)[
        : global_batch - sum(samples.values())
    ]:
        samples[name] += 1
    return {"measured_performance": dict(throughput), "workload_distribution": shares, "samples_per_step": samples}


@dataclass(frozen=True)
class Stage:
    """One epoch of a batch-size schedule: the micro-batch stays, accumulation changes."""

    epoch: int
    global_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float | None


def batch_schedule(
    start: int,
    maximum: int,
    epochs: int,
    *,
    micro_batch_size: int,
    devices: int = 1,
    ramp: str = "linear",
    base_lr: float | None = None,
    base_batch_size: int | None = None,
    lr_scaling: str = "linear",
    unit: int = 1,
) -> list[Stage]:
    """A batch-size ramp (Smith et al. 2018, "Don't Decay the Learning Rate, Increase the Batch
    Size"): ramp the global batch from ``start`` to ``maximum`` over ``epochs``,
    realised by the accumulation steps (rounded to whole micro-batches), with the learning rate
    following ``lr_scaling`` at every stage. ``unit`` converts samples to the unit
    ``base_batch_size`` is in (the sequence length when it counts tokens)."""
    from batchfit.planning.lr import scale_learning_rate

    if ramp not in ("linear", "exponential"):
        raise InputError(f"ramp must be 'linear' or 'exponential', got {ramp!r}")
    if not 1 <= start <= maximum or epochs < 1:
        raise InputError(f"need 1 <= start <= maximum and epochs >= 1, got {start=}, {maximum=}, {epochs=}")
    per_step = micro_batch_size * devices
    stages = []
    for epoch in range(epochs):
        fraction = epoch / max(1, epochs - 1)
        wanted = start + (maximum - start) * fraction if ramp == "linear" else start * (maximum / start) ** fraction
        accumulation = max(1, round(wanted / per_step))
        size = accumulation * per_step
        lr = (
            scale_learning_rate(base_lr, size * unit / base_batch_size, lr_scaling)
            if base_lr and base_batch_size
            else None
        )
        stages.append(Stage(epoch, size, accumulation, lr))
    return stages
