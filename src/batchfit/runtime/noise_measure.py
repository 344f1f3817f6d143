"""measure_noise_scale: the gradient noise scale from a short run (McCandlish et al. 2018, A.1).

Every step splits its batch into micro-batches: each micro-batch's gradient is a small-batch
estimate, their sample-weighted mean is the big batch's gradient. Under torch.distributed each
rank's micro-batches are small batches too, and the big batch is the whole global batch, so k
micro-batches on one rank and k ranks give the same estimate. Loss scaling (a GradScaler, or any
constant) is divided out of |G|² and tr Σ; a loss that sums over the batch is turned into a mean.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import torch

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.planning.noise import NoiseScale
from batchfit.planning.noise import NoiseScaleEstimator
from batchfit.search import distributed
from batchfit.step.batching import batch_length
from batchfit.step.batching import slice_batch
from batchfit.step.state import StateSnapshot
from batchfit.step.workload import compute_loss


def _batches(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches, starting over when it ends (an epoch is not a measurement)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise InputError("the loader gave no batch: pass an iterable of batches, e.g. a DataLoader")


class _Step:
    """One step's gradient statistics: the sum of squared micro-batch gradient norms, their
    count and inverse sizes, and the sample-weighted sum of their gradients."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.big = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        self.small_sq = torch.zeros((), dtype=torch.float64, device=params[0].device)
        self.count, self.inverse_sizes, self.samples = 0, 0.0, 0

    def add(self, size: int, scale: float) -> None:
        """Count the parameters' current ``.grad`` (divided by the loss scale) as one small batch."""
        self.add_gradients([p.grad.double() / scale if p.grad is not None else None for p in self.params], size)

    def add_gradients(self, grads: list[torch.Tensor | None], size: int) -> None:
        for total, grad in zip(self.big, grads, strict=True):
            if grad is not None:
                self.small_sq += grad.pow(2).sum()
                total.add_(grad, alpha=size)
        self.count, self.inverse_sizes, self.samples = (
            self.count + 1,
            self.inverse_sizes + 1 / size,
            self.samples + size,
        )

    def reduce(self) -> None:
        """Sum everything over the ranks (the same collectives on every rank)."""
        import torch.distributed as dist

        for total in self.big:
            dist.all_reduce(total)
        counts = torch.tensor(
            [self.count, self.inverse_sizes, self.samples], dtype=torch.float64, device=self.small_sq.device
        )
        dist.all_reduce(counts)
        dist.all_reduce(self.small_sq)
        self.count, self.inverse_sizes, self.samples = int(counts[0]), float(counts[1]), int(counts[2])

    def statistics(self) -> tuple[float, float, float, float] | None:
        """``(small_sq, small_batch, big_sq, big_batch)``, or ``None`` for a non-finite step (an fp16 overflow)."""
        big_sq = sum(float((total / self.samples).pow(2).sum()) for total in self.big)
        small_sq = float(self.small_sq) / self.count
        if not (math.isfinite(big_sq) and math.isfinite(small_sq)) or self.count < 2:
            return None
        return small_sq, self.count / self.inverse_sizes, big_sq, float(self.samples)


class GradientWatcher:
    """The noise scale measured passively inside gradient accumulation: ``after(weight, share)``
    after each micro-batch's backward recovers that micro-batch's own gradient from the growth of
    ``.grad`` (it added ``share`` times its gradient); ``finish(estimator)`` adds the step. Costs
    two float64 copies of the gradients while a step accumulates."""

    def __init__(self, model: torch.nn.Module, scaler: Any = None):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.scale = float(scaler.get_scale()) if scaler is not None else 1.0
        self.step = _Step(self.params)
        self.previous = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]

    def after(self, weight: int, share: float) -> None:
        # a copy: .double() of a float64 gradient is the gradient itself, which the next backward grows
        current = [
            p.grad.to(torch.float64, copy=True) if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
            for p in self.params
        ]
        own = [(now - before) / (share * self.scale) for now, before in zip(current, self.previous, strict=True)]
        self.step.add_gradients(own, weight)
        self.previous = current

    def finish(self, estimator: NoiseScaleEstimator) -> None:
        """Add this step (summed over the ranks under torch.distributed) to ``estimator``."""
        if distributed.active():
            self.step.reduce()
        statistics = self.step.statistics()
        if statistics is not None:
            estimator.update(*statistics)


def _backward(
    model: torch.nn.Module,
    piece: Any,
    size: int,
    loss_fn: Callable | None,
    step_fn: Callable | None,
    scaler: Any,
    reduction: str,
) -> None:
    with model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext():
        loss = compute_loss(model, piece, loss_fn=loss_fn, step_fn=step_fn)
        if reduction == "sum":
            loss = loss / size
        (scaler.scale(loss) if scaler is not None else loss).backward()


def _check(steps: int, micro_batch_size: int | None, reduction: str, optimizer: Any, params: list) -> None:
    if not isinstance(steps, int) or steps < 2:
        raise InputError(f"steps must be an integer of at least 2, got {steps!r}")
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise InputError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")
    if reduction not in ("mean", "sum"):
        raise InputError(f"reduction must be 'mean' or 'sum' (how the loss reduces over the batch), got {reduction!r}")
    if not params:
        raise InputError("the model has no parameters that require grad: there is no gradient to measure")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _pieces(batch: Any, micro_batch_size: int | None) -> list[Any]:
    length = batch_length(batch)
    size = micro_batch_size or (length if distributed.active() else max(1, length // 2))
    if size >= length and not distributed.active():
        raise InputError(
            f"a batch of {length} rows does not split into micro-batches of {size}: the noise scale needs at least two "
            "small batches per step (use a smaller micro_batch_size or larger batches)"
        )
    return [slice_batch(batch, start, start + size) for start in range(0, length, size)]


def measure_noise_scale(
    model: torch.nn.Module,
    loader: Iterable[Any],
    *,
    loss_fn: Callable | None = None,
    step_fn: Callable | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 50,
    micro_batch_size: int | None = None,
    scaler: Any = None,
    reduction: str = "mean",
    ema_decay: float | None = None,
) -> NoiseScale:
    """Measure the simple noise scale ``B_simple = tr(Σ)/|G|²`` over ``steps`` batches of ``loader``.

    Each batch is split into micro-batches of ``micro_batch_size`` (default: two halves on one
    process; each rank's whole batch under torch.distributed): they are the small batches, the
    whole (global) batch the big one. Batches follow the calling convention of ``Workload``
    (``loss_fn``/``step_fn``); the loss is a mean over its batch unless ``reduction="sum"``.
    ``optimizer=None`` keeps the parameters fixed (a measurement at the current point; every bit
    of state is restored afterwards); with an optimizer it trains on the big batch's gradient
    while measuring (through ``scaler`` if given), and ``ema_decay`` (e.g. 0.99) weights recent steps.

    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(4, 1)
    >>> data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(8)]
    >>> noise = measure_noise_scale(model, data, loss_fn=torch.nn.functional.mse_loss, steps=20, micro_batch_size=4)
    >>> noise.b_simple > 0 and noise.small_batch_size == 4 and noise.big_batch_size == 16
    True
    """
    params = [p for p in model.parameters() if p.requires_grad]
    _check(steps, micro_batch_size, reduction, optimizer, params)
    estimator = NoiseScaleEstimator(ema_decay)
    snapshot = StateSnapshot.take(model, None) if optimizer is None else None
    try:
        for _, batch in zip(range(steps), _batches(loader), strict=False):
            step = _Step(params)
            scale = float(scaler.get_scale()) if scaler is not None else 1.0
            for piece in _pieces(batch, micro_batch_size):
                model.zero_grad(set_to_none=True)
                size = batch_length(piece)
                _backward(model, piece, size, loss_fn, step_fn, scaler, reduction)
                step.add(size, scale)
            if distributed.active():
                step.reduce()
            statistics = step.statistics()
            if statistics is not None:
                estimator.update(*statistics)
            if optimizer is not None:
                _train(optimizer, params, step, scale, scaler)
    finally:
        model.zero_grad(set_to_none=True)
        if snapshot is not None:
            snapshot.restore()
    return estimator.result()


def _train(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: _Step, scale: float, scaler: Any
) -> None:
    """One optimizer step on the big batch's gradient (scaled again for a GradScaler)."""
    for param, total in zip(params, step.big, strict=True):
        param.grad = (total / step.samples * scale).to(param.dtype)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
