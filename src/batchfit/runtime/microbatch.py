"""Keep training alive: split each global batch into micro-batches that fit, and on an OOM
shrink and replay the whole global batch, so no sample is lost or counted twice and the
optimizer steps exactly once (the idea of Composer's automatic micro-batching, growing back too).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.devices.cleanup import drain_autograd_queue
from batchfit.devices.oom import is_oom
from batchfit.devices.resolve import resolve_device
from batchfit.planning.noise import NoiseScaleEstimator
from batchfit.runtime.accumulate import backward_micro_batches
from batchfit.runtime.noise_measure import GradientWatcher
from batchfit.search import distributed
from batchfit.step.batching import batch_length
from batchfit.step.batching import slice_batch
from batchfit.step.compiled import runnable
from batchfit.step.state import StateSnapshot
from batchfit.step.workload import compute_loss

logger = logging.getLogger("batchfit")


@dataclass(frozen=True)
class StepRecord:
    """One global step: the micro-batch size that completed it, and what it took to get there."""

    step: int
    micro_batch_size: int
    micro_batches: int
    ooms: int
    replays: int
    samples: int


def _accounting(device: Any) -> contextlib.AbstractContextManager:
    """Only a simulated device needs its accounting active to raise OOM; real allocators raise their own."""
    return device.measuring() if device.simulated else contextlib.nullcontext()


def default_tokens_per_sample(batch: Any) -> torch.Tensor:
    """Tokens in each sample: the sum of ``attention_mask`` where there is one, else the length
    of the sequence dimension of the first tensor with one."""
    from collections.abc import Mapping

    from batchfit.step.batching import tensor_leaves

    if isinstance(batch, Mapping) and "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1)
    sequence = next((t for t in tensor_leaves(batch) if t.dim() >= 2), None)
    if sequence is None:
        raise ValueError("max_tokens needs sequences: give tokens_per_sample(batch) -> tokens of each sample")
    return torch.full((sequence.shape[0],), sequence.shape[1])


class Microbatcher:
    """One optimizer step per global batch, in micro-batches that fit, surviving OOM.

    On an out-of-memory error anywhere in the step, gradients are dropped, the cache emptied, a
    partial GradScaler step undone, and the micro-batch halved; then the *whole* global batch is
    replayed. An OOM inside ``optimizer.step()`` cannot be fixed by smaller micro-batches and may
    have updated some parameters: with ``guard_optimizer_step=True`` (a host copy of parameters and
    optimizer state before every step, which costs a device-to-host copy per step) it is undone
    and the step runs again per parameter (``foreach=False``); without it, a clear error says so.
    After ``grow_after`` clean steps it tries twice the size again, never above one that failed.
    With ``max_tokens``, micro-batches are contiguous runs of samples holding at most that many
    tokens (``tokens_per_sample``, by default from ``attention_mask`` or the sequence length), and
    it is the token budget that halves on OOM. ``weight`` must match how the loss is reduced:
    ``"samples"`` for a mean over samples, ``"tokens"`` for a mean over tokens (Hugging Face
    causal-LM losses); only then is the accumulated gradient the full batch's. ``noise`` (a
    ``NoiseScaleEstimator``) measures the gradient noise scale on the way: micro-batches are the
    small batch, the global step the big one (read it with ``noise.result()``).

    >>> model = torch.nn.Linear(4, 1)
    >>> batcher = Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1),
    ...                        loss_fn=torch.nn.functional.mse_loss, micro_batch_size=8)
    >>> loss = batcher.step((torch.randn(20, 4), torch.randn(20, 1)))
    >>> batcher.history[-1].micro_batches
    3
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable | None = None,
        step_fn: Callable | None = None,
        device: Any = None,
        micro_batch_size: int | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        grow_after: int | None = 100,
        guard_optimizer_step: bool = False,
        sample_weight: Callable[[Any], int] | None = None,
        max_tokens: int | None = None,
        tokens_per_sample: Callable[[Any], torch.Tensor] | None = None,
        weight: str = "samples",
        noise: NoiseScaleEstimator | None = None,
    ):
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
        if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
            raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size!r}")
        if grow_after is not None and grow_after < 1:
            raise ValueError(f"grow_after must be at least 1 or None, got {grow_after!r}")
        self.model, self.optimizer = model, optimizer
        self.loss_fn, self.step_fn = loss_fn, step_fn
        self.device = resolve_device(device, model)
        self.micro_batch_size = micro_batch_size
        self.scheduler, self.scaler = scheduler, scaler
        self.grow_after, self.guard_optimizer_step = grow_after, guard_optimizer_step
        if weight not in ("samples", "tokens"):
            raise ValueError(
                f"weight must be 'samples' (a loss averaged per sample) or 'tokens' (a loss averaged per token), got {weight!r}"
            )
        self.max_tokens = max_tokens
        self.tokens_per_sample = tokens_per_sample or default_tokens_per_sample
        token_weight = lambda piece: int(self.tokens_per_sample(piece).sum())  # noqa: E731
        self.sample_weight = sample_weight or (token_weight if weight == "tokens" else batch_length)
        self.smallest_failure: int | None = None
        self.history: list[StepRecord] = []
        self.noise = noise  # the gradient noise scale, measured passively from the micro-batches
        self._watcher: GradientWatcher | None = None
        self._clean_steps = 0

    # -- the step --------------------------------------------------------------------------------

    def step(self, batch: Any) -> float:
        """Train on ``batch`` (the whole global batch): one optimizer step. Returns the mean loss.

        Under a process group, ranks agree after the micro-batches whether any ran out of memory
        and then all shrink and replay together; DDP gradients are averaged once, explicitly, so no
        rank ever waits in a gradient all-reduce that an out-of-memory rank will never join.
        """
        total = batch_length(batch)
        size = self.max_tokens if self.max_tokens is not None else min(self._current_size(batch), total)
        agreeing = distributed.active()
        self._check_token_budget(batch, size, agreeing)
        ooms = replays = 0
        while True:
            slices = self._slices(batch, size)
            with _accounting(self.device):
                loss = self._accumulate(batch, slices, size, local_only=agreeing)
            failed = loss is None
            if agreeing and distributed.any_rank(failed) and not failed:
                failed = True
                self._clean_up("another rank ran out of memory")
            if not failed:
                break
            ooms += 1
            replays += 1
            size = self._shrink(size)
        if self._watcher is not None:
            self._watcher.finish(self.noise)  # each rank's own micro-batches, before averaging
        if agreeing and hasattr(self.model, "no_sync"):
            distributed.average_gradients(self.model)
        self._optimizer_step()
        if ooms and self.max_tokens is not None:
            self.max_tokens = size
        elif ooms:
            self.micro_batch_size = size  # only a failure shrinks it: a short batch does not
        largest = max(stop - start for start, stop in slices)
        self.history.append(StepRecord(len(self.history), largest, len(slices), ooms, replays, total))
        self._maybe_grow(ooms)
        return loss

    def _current_size(self, batch: Any) -> int:
        if self.micro_batch_size is None:
            from batchfit.search.runner import find_max_batch_size

            found = find_max_batch_size(
                self.model,
                batch,
                loss_fn=self.loss_fn,
                optimizer=self.optimizer,
                step_fn=self.step_fn,
                device=self.device,
                max_batch_size=batch_length(batch),
            )
            self.micro_batch_size = found.batch_size
        return self.micro_batch_size

    def _accumulate(
        self, batch: Any, slices: list[tuple[int, int]], size: int, local_only: bool = False
    ) -> float | None:
        """Backward over the micro-batches ``slices``; the mean loss, or ``None`` after an OOM
        (cleaned up). DDP synchronises on the last micro-batch only, or never with ``local_only``."""
        pieces = [slice_batch(batch, start, stop) for start, stop in slices]
        self._watcher = GradientWatcher(self.model, self.scaler) if self.noise is not None else None
        watch = self._watcher.after if self._watcher is not None else None
        try:
            return backward_micro_batches(
                runnable(self.model, self.device),
                pieces,
                [self.sample_weight(piece) for piece in pieces],
                loss_fn=self.loss_fn,
                step_fn=self.step_fn,
                scaler=self.scaler,
                sync_last=not local_only,
                after_each=watch,
            )
        except BaseException as error:
            if not is_oom(error):
                raise
            why = f"{type(error).__name__} in forward/backward at micro-batch {size}"
        self._clean_up(why)  # after the except block, so the failed micro-batch's tensors are free
        return None

    def _check_token_budget(self, batch: Any, size: int, agreeing: bool) -> None:
        """A sample longer than the budget cannot be split: every rank learns it before any raises."""
        if self.max_tokens is None:
            return
        longest = int(self.tokens_per_sample(batch).max())
        too_long = longest > size
        if agreeing:
            too_long = distributed.any_rank(too_long)
        if too_long:
            raise RuntimeError(
                f"a single sample holds more tokens ({longest} here) than the budget of {size}: raise max_tokens or free memory"
            )

    def _slices(self, batch: Any, size: int) -> list[tuple[int, int]]:
        """Row ranges of the micro-batches: ``size`` rows each, or at most ``size`` tokens each."""
        total = batch_length(batch)
        if self.max_tokens is None:
            return [(start, min(start + size, total)) for start in range(0, total, size)]
        tokens = [int(count) for count in self.tokens_per_sample(batch)]
        if max(tokens) > size:
            raise RuntimeError(
                f"a single sample holds {max(tokens)} tokens, more than the budget of {size}: raise max_tokens or free memory"
            )
        slices, start, held = [], 0, 0
        for row, count in enumerate(tokens):
            if held + count > size:
                slices.append((start, row))
                start, held = row, 0
            held += count
        slices.append((start, total))
        return slices

    def _optimizer_step(self) -> None:
        snapshot = self._guard()  # in host memory, outside the device's accounting
        failed = False
        try:
            with _accounting(self.device):
                self._step_once()
        except BaseException as error:
            if not is_oom(error):
                raise
            if snapshot is None:
                raise RuntimeError(
                    "the optimizer step ran out of memory and may have updated some parameters already: "
                    "use Microbatcher(..., guard_optimizer_step=True) to undo and retry it exactly, or free memory"
                ) from error
            failed = True  # recover after the except block: its traceback holds the partial step's tensors
        if failed:
            snapshot.restore()
            self.device.collect()
            self._undo_scaler()
            with _accounting(self.device):
                self._retry_per_parameter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _step_once(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _guard(self) -> StateSnapshot | None:
        if not self.guard_optimizer_step:
            return None
        return StateSnapshot.take(self.model, self.optimizer)

    def _retry_per_parameter(self) -> None:
        """The optimizer step itself ran out of memory: a smaller micro-batch cannot help, but
        per-parameter updates (``foreach=False``) need far smaller temporaries."""
        groups = self.optimizer.param_groups
        saved = [group.get("foreach") for group in groups]
        for group in groups:
            group["foreach"] = False
        try:
            self._step_once()
        finally:
            for group, foreach in zip(groups, saved, strict=True):
                group["foreach"] = foreach
        logger.warning("batchfit: the optimizer step ran out of memory; it ran again per parameter (foreach=False)")

    # -- recovery --------------------------------------------------------------------------------

    def _clean_up(self, why: str) -> None:
        drain_autograd_queue()  # a backward cut short by the OOM keeps its activations queued (CPU devices)
        self.optimizer.zero_grad(set_to_none=True)
        self._undo_scaler()
        self.device.collect()
        logger.warning("batchfit: %s; replaying the global batch with smaller micro-batches", why)

    def _undo_scaler(self) -> None:
        if self.scaler is not None:
            # GradScaler keeps "unscaled / stepped" flags per optimizer until update(); a step cut
            # short by an OOM must start over from a clean slate (torch's own reset is update()).
            self.scaler._per_optimizer_states.clear()

    def _shrink(self, size: int) -> int:
        self.smallest_failure = size if self.smallest_failure is None else min(self.smallest_failure, size)
        self._clean_steps = 0
        if self.max_tokens is not None and size // 2 < 1:
            raise RuntimeError(f"even a budget of 1 token runs out of memory on {self.device.name}")
        if size == 1:
            raise RuntimeError(
                f"even a micro-batch of 1 runs out of memory on {self.device.name}: free memory or shrink the model (AMP, checkpointing)"
            )
        return size // 2

    def _maybe_grow(self, ooms: int) -> None:
        if self.max_tokens is not None:
            return  # the token budget only shrinks
        self._clean_steps = 0 if ooms else self._clean_steps + 1
        if self.grow_after is None or self._clean_steps < self.grow_after or self.smallest_failure is None:
            return
        grown = min(2 * self.micro_batch_size, self.smallest_failure)
        if grown > self.micro_batch_size:
            self.micro_batch_size = grown
            self._clean_steps = 0


class EvalMicrobatcher:
    """Forward passes under ``torch.no_grad()`` in micro-batches that fit, shrinking on OOM.

    It keeps its own size, so evaluation never shrinks (or waits for) the training micro-batch.
    ``run(batch)`` returns the outputs of the whole batch, concatenated along the batch dimension.

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
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
        self.model = model
        self.device = resolve_device(device, model)
        self.micro_batch_size = micro_batch_size
        self.forward_fn = forward_fn or (lambda model, batch: compute_loss(model, batch, need_loss=False))
        self.ooms = 0

    def run(self, batch: Any) -> Any:
        """The model's outputs for the whole ``batch``, computed in micro-batches that fit."""
        total = batch_length(batch)
        while True:
            size = min(self.micro_batch_size, total)
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
                raise RuntimeError(f"even one sample runs out of memory in evaluation on {self.device.name}")
            self.micro_batch_size = size // 2
        if len(outputs) == 1:
            return outputs[0]
        return torch.utils._pytree.tree_map(lambda *parts: torch.cat(parts), *outputs)

    def _forward_all(self, batch: Any, size: int) -> list[Any]:
        accounting = _accounting(self.device)
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
