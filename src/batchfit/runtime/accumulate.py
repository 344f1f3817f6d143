"""Gradient accumulation that gives the full batch's gradient exactly, on one process and under DDP.

Each micro-batch's mean loss is weighted by its share of the global batch's samples, so a short
last micro-batch counts for what it holds; under DDP only the last micro-batch synchronises
(``no_sync()`` on the others). The optimizer, the scheduler and the EMA step once per global step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from batchfit.errors import InputError
from batchfit.planning.noise import NoiseScaleEstimator
from batchfit.runtime.noise_measure import GradientWatcher
from batchfit.search import distributed
from batchfit.step.batching import batch_length
from batchfit.step.batching import slice_batch
from batchfit.step.workload import autocast
from batchfit.step.workload import compute_loss


def backward_micro_batches(
    model: torch.nn.Module,
    pieces: list[Any],
    weights: list[int],
    *,
    loss_fn: Callable | None = None,
    step_fn: Callable | None = None,
    scaler: Any = None,
    sync_last: bool = True,
    after_each: Callable[[int, float], None] | None = None,
    amp_dtype: torch.dtype | None = None,
    device_type: str = "cpu",
) -> float:
    """Backward over ``pieces``, each mean loss weighted by its share of ``weights``; ``.grad`` then
    holds the gradient of the whole batch's mean loss. Under DDP every backward but the last runs in
    ``no_sync()`` (all of them without ``sync_last``). The loss is summed where it is and read once,
    so there is no device sync per micro-batch. ``after_each(weight, share)`` runs after every
    backward (the gradient noise scale watches there). With ``amp_dtype`` the forward pass and the
    loss run under ``torch.autocast(device_type, amp_dtype)``, the backward outside it. Returns the
    mean loss."""
    whole = sum(weights)
    defers = hasattr(model, "no_sync")
    total = None
    for index, (piece, weight) in enumerate(zip(pieces, weights, strict=True)):
        defer = defers and (not sync_last or index < len(pieces) - 1)
        with model.no_sync() if defer else contextlib.nullcontext():
            with autocast(device_type, amp_dtype):
                loss = compute_loss(model, piece, loss_fn=loss_fn, step_fn=step_fn) * (weight / whole)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss
        if after_each is not None:
            after_each(weight, weight / whole)
    return float(total)


class GradientAccumulator:
    """One optimizer step per global batch, computed ``micro_batch_size`` rows at a time.

    ``noise`` (a ``NoiseScaleEstimator``) measures the gradient noise scale passively: each
    micro-batch is a small batch and the global batch the big one (under DDP, every rank's
    micro-batches; the gradients are then averaged once, explicitly).

    >>> model = torch.nn.Linear(4, 1)
    >>> accumulator = GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...     loss_fn=torch.nn.functional.mse_loss, micro_batch_size=3)
    >>> loss = accumulator.step((torch.randn(10, 4), torch.randn(10, 1)))   # micro-batches of 3, 3, 3, 1
    >>> accumulator.micro_batches_last_step
    4
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        micro_batch_size: int,
        loss_fn: Callable | None = None,
        step_fn: Callable | None = None,
        scheduler: Any = None,
        ema: Any = None,
        scaler: Any = None,
        sample_weight: Callable[[Any], int] | None = None,
        noise: NoiseScaleEstimator | None = None,
    ):
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise InputError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        self.model, self.optimizer = model, optimizer
        self.micro_batch_size = micro_batch_size
        self.loss_fn, self.step_fn = loss_fn, step_fn
        self.scheduler, self.ema, self.scaler = scheduler, ema, scaler
        self.sample_weight = sample_weight or batch_length  # tokens instead: lambda b: int(b["attention_mask"].sum())
        self.micro_batches_last_step = 0
        self.noise = noise  # measured passively: micro-batches are the small batch, the step the big one

    def accumulate(self, batch: Any) -> float:
        """Backward over every micro-batch of ``batch``; ``.grad`` then holds the full batch's
        gradient (of the mean loss). Returns the mean loss."""
        total = batch_length(batch)
        pieces = [
            slice_batch(batch, start, start + self.micro_batch_size) for start in range(0, total, self.micro_batch_size)
        ]
        watcher = GradientWatcher(self.model, self.scaler) if self.noise is not None else None
        local = watcher is not None and distributed.active() and hasattr(self.model, "no_sync")
        loss = backward_micro_batches(
            self.model,
            pieces,
            [self.sample_weight(piece) for piece in pieces],
            loss_fn=self.loss_fn,
            step_fn=self.step_fn,
            scaler=self.scaler,
            sync_last=not local,
            after_each=watcher.after if watcher is not None else None,
        )
        if watcher is not None:
            watcher.finish(self.noise)  # before DDP averages: each rank's own gradients are small batches too
        if local:
            distributed.average_gradients(self.model)
        self.micro_batches_last_step = len(pieces)
        return loss

    def step(self, batch: Any) -> float:
        """``accumulate(batch)``, then one optimizer step (and scheduler, EMA), then zero grads."""
        loss = self.accumulate(batch)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        return loss
