"""The critical batch size measured by short training runs: train briefly at doubling batch sizes,
the learning rate scaled, for the same number of samples each, and find where validation loss stops
holding up.

Expensive by nature: one short training run per batch size. ``measure_noise_scale`` answers the
same question from gradient statistics in a few dozen steps; this is the check against reality.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import InputError
from batchfit.planning.lr import scale_learning_rate
from batchfit.step.batching import batch_length
from batchfit.step.batching import select_rows
from batchfit.step.workload import compute_loss

Build = Callable[[float], tuple[torch.nn.Module, torch.optim.Optimizer]]
VALIDATION_CHUNK = 1024  # validation rows per forward pass


@dataclass(frozen=True)
class EmpiricalPoint:
    """One short run: its batch, learning rate, steps, samples and final validation loss."""

    batch_size: int
    learning_rate: float
    steps: int
    samples: int
    validation_loss: float


@dataclass(frozen=True)
class EmpiricalCritical:
    """Every run, and the largest batch (from the smallest up) whose validation loss stayed within
    ``tolerance`` of the best."""

    points: list[EmpiricalPoint]
    critical_batch_size: int
    tolerance: float

    def summary(self) -> str:
        return (
            f"Validation loss holds within {self.tolerance:.0%} of the best up to batch size "
            f"{self.critical_batch_size} after {self.points[0].samples:,} samples each (one short training run per batch size)."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "critical_batch_size": self.critical_batch_size,
            "tolerance": self.tolerance,
            "points": [asdict(p) for p in self.points],
        }


def _train(
    build: Build,
    train: Any,
    batch_size: int,
    lr: float,
    steps: int,
    seed: int,
    loss_fn: Callable | None,
    step_fn: Callable | None,
) -> torch.nn.Module:
    torch.manual_seed(seed)
    model, optimizer = build(lr)
    model.train()
    length = batch_length(train)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(length, generator=generator)
    position = 0
    for _ in range(steps):
        if position + batch_size > length:  # a new epoch: reshuffle
            order, position = torch.randperm(length, generator=generator), 0
        batch = select_rows(train, order[position : position + batch_size])
        position += batch_size
        compute_loss(model, batch, loss_fn=loss_fn, step_fn=step_fn).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@torch.no_grad()
def _validation_loss(
    model: torch.nn.Module, validation: Any, loss_fn: Callable | None, step_fn: Callable | None
) -> float:
    model.eval()
    length = batch_length(validation)
    total = 0.0
    for start in range(0, length, VALIDATION_CHUNK):
        rows = torch.arange(start, min(start + VALIDATION_CHUNK, length))
        total += float(compute_loss(model, select_rows(validation, rows), loss_fn=loss_fn, step_fn=step_fn)) * len(rows)
    return total / length


def _plateau(points: list[EmpiricalPoint], tolerance: float) -> int:
    best = min(p.validation_loss for p in points)
    critical = points[0].batch_size
    for point in points:
        if point.validation_loss > best + tolerance * abs(best):
            break
        critical = point.batch_size
    return critical


def critical_batch_by_training(
    build: Build,
    train: Any,
    validation: Any,
    *,
    samples: int,
    base_lr: float,
    base_batch_size: int | None = None,
    batch_sizes: Sequence[int] = (32, 64, 128, 256, 512),
    lr_scaling: str = "linear",
    loss_fn: Callable | None = None,
    step_fn: Callable | None = None,
    tolerance: float = 0.02,
    seed: int = 0,
) -> EmpiricalCritical:
    """The critical batch by short training runs: for each batch size, ``build(lr)`` a fresh ``(model, optimizer)``, train on
    ``samples`` rows of ``train`` (shuffled, same seed), the learning rate ``base_lr`` scaled from
    ``base_batch_size`` (default: the smallest size) by ``lr_scaling``; then the mean validation
    loss. The critical batch is the largest size, going up from the smallest, whose loss stays
    within ``tolerance`` (relative) of the best. Costs one training run per size.

    >>> X = torch.randn(512, 4); Y = X @ torch.ones(4, 1)
    >>> def build(lr):
    ...     model = torch.nn.Linear(4, 1)
    ...     return model, torch.optim.SGD(model.parameters(), lr=lr)
    >>> result = critical_batch_by_training(build, (X, Y), (X, Y), samples=2048, base_lr=0.05,
    ...     batch_sizes=(8, 16, 32), loss_fn=torch.nn.functional.mse_loss)
    >>> [p.steps for p in result.points]
    [256, 128, 64]
    """
    sizes = sorted(set(batch_sizes))
    if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes):
        raise InputError(f"batch_sizes must be positive integers, got {batch_sizes!r}")
    if not isinstance(samples, int) or samples < sizes[-1]:
        raise InputError(f"samples must be an integer of at least the largest batch ({sizes[-1]}), got {samples!r}")
    if sizes[-1] > batch_length(train):
        raise InputError(
            f"the largest batch ({sizes[-1]}) is larger than the training data ({batch_length(train)} rows)"
        )
    base = base_batch_size or sizes[0]
    points = []
    for size in sizes:
        lr = scale_learning_rate(base_lr, size / base, lr_scaling)
        model = _train(build, train, size, lr, samples // size, seed, loss_fn, step_fn)
        loss = _validation_loss(model, validation, loss_fn, step_fn)
        points.append(EmpiricalPoint(size, lr, samples // size, samples // size * size, loss))
    return EmpiricalCritical(points, _plateau(points, tolerance), tolerance)
