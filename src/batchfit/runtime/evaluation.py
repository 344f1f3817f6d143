"""Evaluation that keeps going: forward passes in micro-batches that fit, halving on an OOM,
with a size of its own so evaluation never shrinks the training micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from batchfit.devices.oom import is_oom
from batchfit.devices.resolve import resolve_device
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.runtime.microbatch import device_accounting
from batchfit.runtime.microbatch import warn_renamed
from batchfit.step.batching import batch_length
from batchfit.step.batching import slice_batch
from batchfit.step.compiled import runnable
from batchfit.step.workload import compute_loss


@dataclass(frozen=True)
class EvalSettings:
    """What the caller gave an ``EvalMicrobatcher``: the first micro-batch size, never changed."""

    micro_batch_size: int = 64

    def __post_init__(self) -> None:
        size = self.micro_batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"micro_batch_size must be a positive integer, got {size!r}")


class EvalMicrobatcher:
    """Forward passes under ``torch.no_grad()`` in micro-batches that fit, shrinking on OOM.

    It keeps its own size, so evaluation never shrinks (or waits for) the training micro-batch.
    ``run(batch)`` returns the outputs of the whole batch, concatenated along the batch dimension.
    What you gave stays in ``settings``; the live size is ``current_micro_batch_size``, and ``ooms``
    counts the out-of-memory errors so far. If even one sample runs out of memory it raises
    ``NoBatchFitsError``.

    >>> evaluator = EvalMicrobatcher(torch.nn.Linear(4, 2), micro_batch_size=3)
    >>> evaluator.run(torch.randn(10, 4)).shape
    torch.Size([10, 2])
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: Any = None,
        micro_batch_size: int = 64,
        forward_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    ):
        self.settings = EvalSettings(micro_batch_size)
        self.model = model
        self.device = resolve_device(device, model)
        self.forward_fn = forward_fn or (lambda model, batch: compute_loss(model, batch, need_loss=False))
        self.current_micro_batch_size = micro_batch_size  # live: halves on every OOM
        self.ooms = 0

    @property
    def micro_batch_size(self) -> int:
        """Deprecated: ``current_micro_batch_size`` (the live size; ``settings.micro_batch_size`` is yours)."""
        warn_renamed("EvalMicrobatcher", "micro_batch_size", "current_micro_batch_size")
        return self.current_micro_batch_size

    @micro_batch_size.setter
    def micro_batch_size(self, size: int) -> None:
        warn_renamed("EvalMicrobatcher", "micro_batch_size", "current_micro_batch_size")
        self.current_micro_batch_size = size

    def run(self, batch: Any) -> Any:
        """The model's outputs for the whole ``batch``, computed in micro-batches that fit."""
        total = batch_length(batch)
        while True:
            size = min(self.current_micro_batch_size, total)
            try:
                outputs = self._forward_all(batch, size)
                break
            except BaseException as error:
                if not is_oom(error):
                    raise
            # only after an OOM, and outside the except block, whose traceback holds the outputs so far
            self.ooms += 1
            self.device.collect()
            if size == 1:
                raise NoBatchFitsError(
                    f"even one sample runs out of memory in evaluation on {self.device.name}: "
                    "use autocast, a smaller model or shorter inputs, or free memory",
                    [],
                )
            self.current_micro_batch_size = size // 2
        if len(outputs) == 1:
            return outputs[0]
        return pytree.tree_map(lambda *parts: torch.cat(parts), *outputs)

    def _forward_all(self, batch: Any, size: int) -> list[Any]:
        accounting = device_accounting(self.device)
        training = self.model.training
        self.model.eval()
        try:
            with accounting, torch.no_grad():
                return [
                    self.forward_fn(runnable(self.model, self.device), slice_batch(batch, start, start + size))
                    for start in range(0, batch_length(batch), size)
                ]
        finally:
            self.model.train(training)
