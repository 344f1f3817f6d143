"""Learning-rate scaling for a larger batch, and the warmup it calls for. Pure arithmetic."""

from __future__ import annotations

import math
from collections.abc import Callable

from batchfit.errors import InputError

LR_RULES = ("linear", "sqrt", "none")


def scale_learning_rate(base_lr: float, scale: float, rule: str) -> float:
    """``base_lr`` for a batch ``scale`` times the one it was tuned at.

    ``linear``: Goyal et al. 2017 ("Accurate, Large Minibatch SGD"); ``sqrt``: Krizhevsky 2014
    ("One weird trick"), and Malladi et al. 2022 ("On the SDEs and Scaling Rules for Adaptive
    Gradient Algorithms") for Adam; ``none`` keeps it.

    >>> scale_learning_rate(0.1, 1024 / 256, "linear")
    0.4
    """
    if rule not in LR_RULES:
        raise InputError(f"lr_scaling must be one of {', '.join(LR_RULES)}, got {rule!r}")
    factor = {"linear": scale, "sqrt": math.sqrt(scale), "none": 1.0}[rule]
    return base_lr * factor


def warmup_need(scale: float) -> str:
    """How much a batch ``scale`` times the tuned one needs warmup, as a rule of thumb after Goyal et al.
    2017 (who warm up over 5 epochs at 32x): none up to 2x, optional up to 4x, required below 16x,
    critical from 16x."""
    if scale <= 2:
        return "none"
    if scale <= 4:
        return "optional"
    return "required" if scale < 16 else "critical"


def suggested_warmup_epochs(scale: float) -> int:
    """Warmup epochs growing with log2 of the scale, reaching Goyal et al.'s 5 epochs at 32x
    (8192 vs 256 images); none at 2x or less."""
    if scale <= 2:
        return 0
    return min(5, max(1, round(math.log2(scale))))


def warmup_cosine(warmup_steps: int, total_steps: int, schedule: str = "cosine") -> Callable[[int], float]:
    """The LR multiplier at a step: linear warmup from 0, then cosine decay to 0 or constant.

    >>> f = warmup_cosine(10, 110)
    >>> f(0), f(5), f(10), round(f(60), 3), f(110)
    (0.0, 0.5, 1.0, 0.5, 0.0)
    """
    if schedule not in ("cosine", "constant"):
        raise InputError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise InputError(
            f"need 0 <= warmup_steps <= total_steps and total_steps >= 1, got {warmup_steps=}, {total_steps=}"
        )

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier
