"""What undoes a failed attempt at a global step, in host memory (outside the device's accounting): the
optimizer step half-applied (``OptimizerSnapshot``), and the buffers and random state a replay must start from
(``ReplayStart``). Used by the ``Microbatcher``."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.step.state import restore_rng
from batchfit.step.state import save_rng


def host_copy(tensor: torch.Tensor, *, asynchronous: bool = False) -> torch.Tensor:
    """A copy of ``tensor`` in host memory, outside the device's accounting. ``asynchronous`` from CUDA:
    pinned, and ordered on the stream before the work that follows, which need not wait for it (for small
    tensors only: the pinned pool keeps what it once held)."""
    return tensor.detach().to("cpu", copy=True, non_blocking=asynchronous and tensor.is_cuda)


def put_back(tensor: torch.Tensor, saved: torch.Tensor) -> None:
    """``saved`` (a ``host_copy`` of ``tensor``) written back into ``tensor`` in place, bitwise (ordered on
    the stream after an asynchronous ``host_copy``)."""
    with torch.no_grad():
        tensor.copy_(saved, non_blocking=tensor.is_cuda)


@dataclass
class ReplayStart:
    """Where a global step began: host copies of a model's buffers, the buffer objects in each module's
    slots, and every random number generator. ``restore()`` undoes what the failed attempt's forward passes
    did (BatchNorm's running statistics and ``num_batches_tracked``, a buffer a ``forward`` reassigns) and
    drew (dropout's masks), so that the replay runs as if the attempt had never happened.

    >>> norm = torch.nn.BatchNorm1d(2)
    >>> start = ReplayStart.take(norm)
    >>> _ = norm(torch.randn(4, 2))
    >>> start.restore()
    >>> int(norm.num_batches_tracked), norm.running_mean.tolist()
    (0, [0.0, 0.0])
    """

    slots: list[tuple[torch.nn.Module, dict[str, torch.Tensor | None]]]
    values: list[tuple[torch.Tensor, torch.Tensor]]
    rng: dict[str, Any]

    @classmethod
    def take(cls, model: torch.nn.Module) -> ReplayStart:
        """The buffers of ``model`` and the random state as they are now."""
        slots = [(module, dict(module._buffers)) for module in model.modules()]
        values = [(buffer, host_copy(buffer, asynchronous=True)) for buffer in model.buffers()]
        return cls(slots, values, save_rng())

    def restore(self) -> None:
        """The saved objects back under their names, their saved values into them, the random state back."""
        for module, saved in self.slots:
            module._buffers.clear()
            module._buffers.update(saved)
        for buffer, saved_value in self.values:
            put_back(buffer, saved_value)
        restore_rng(self.rng)


@dataclass
class OptimizerSnapshot:
    """Host copies of what an optimizer step may change, and only that: the parameters it updates
    (those with a gradient), their optimizer state and each group's settings; with ``grads`` (under a
    GradScaler, whose step unscales them in place) their gradients too. ``restore()`` puts them back
    bitwise, dropping the state that the step created.

    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.AdamW(model.parameters())
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> weight = model.weight.detach().clone()
    >>> snapshot = OptimizerSnapshot.take(optimizer, grads=False)
    >>> optimizer.step()
    >>> snapshot.restore()
    >>> torch.equal(model.weight, weight), len(optimizer.state)
    (True, 0)
    """

    optimizer: torch.optim.Optimizer
    values: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[torch.Tensor, torch.Tensor]]
    state: dict[torch.Tensor, dict[str, Any] | None]
    groups: list[dict[str, Any]]

    @classmethod
    def take(cls, optimizer: torch.optim.Optimizer, *, grads: bool) -> OptimizerSnapshot:
        """What the next ``optimizer.step()`` may change, as it is now."""
        stepped = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        state = {p: _entries_copy(optimizer.state[p]) if p in optimizer.state else None for p in stepped}
        held = [(p, p.grad) for p in stepped] if grads else []
        tensors = [*stepped, *(grad for _, grad in held), *_tensors_in(state)]
        groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        return cls(optimizer, [(tensor, host_copy(tensor)) for tensor in tensors], held, state, groups)

    def restore(self) -> None:
        """Every saved object back in its place, then the saved values into the tensors."""
        for param, grad in self.grads:
            param.grad = grad
        for param, entries in self.state.items():
            if entries is None:
                self.optimizer.state.pop(param, None)
            else:
                self.optimizer.state[param].clear()
                self.optimizer.state[param].update(_entries_copy(entries))
        for tensor, saved_value in self.values:
            put_back(tensor, saved_value)
        for group, saved in zip(self.optimizer.param_groups, self.groups, strict=True):
            for key in [key for key in group if key != "params" and key not in saved]:
                del group[key]
            group.update(saved)


def _entries_copy(entries: dict[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state: the same tensor objects, copies of everything else."""
    return {key: value if isinstance(value, torch.Tensor) else copy.deepcopy(value) for key, value in entries.items()}


def _tensors_in(state: dict[torch.Tensor, dict[str, Any] | None]) -> list[torch.Tensor]:
    return [value for entries in state.values() if entries for value in entries.values() if torch.is_tensor(value)]
