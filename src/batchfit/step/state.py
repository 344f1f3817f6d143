"""Snapshot everything a probe touches and put it back bitwise.

Parameters, buffers, ``.grad``s, optimizer state (``step`` counts included) and hyper-parameters,
the RNG states (torch CPU and accelerators, Python, NumPy) and every module's train/eval flag.
Parameters and buffers are put back by name too: a ``forward`` that reassigns one
(``self.seen = self.seen + 1``) gets the original tensor object back in its slot.
Copies live in host memory, never on the device being probed.

A model sharded with FSDP2 (``fully_shard``) is brought to rest first (``reset_sharded_iteration``):
a step that raised half-way (an out-of-memory error in forward, loss, backward or the optimizer
step) leaves FSDP2 mid-iteration, its parameters gathered and its hooks' bookkeeping half done, and
a no-grad forward leaves the root's parameters gathered; the module slots must not get the shards
back while FSDP2 still holds the gathered copies (its next forward would mix the two).
"""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np
import torch


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _put_back(current: torch.Tensor | None, saved: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``saved`` written into ``current`` in place when it can be, else a fresh copy on ``device``."""
    same_layout = (
        current is not None
        and current.shape == saved.shape
        and current.dtype == saved.dtype
        and current.device == device
    )
    if same_layout:
        with torch.no_grad():
            current.copy_(saved)
        return current
    return saved.to(device, copy=True)


@dataclass
class _SavedTensor:
    tensor: torch.Tensor
    device: torch.device
    value: torch.Tensor

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _SavedTensor:
        return cls(tensor, tensor.device, _host_copy(tensor))


_SLOT_KINDS = ("_parameters", "_buffers")


@dataclass
class _ModuleSlots:
    """One module's parameter and buffer slots (name -> tensor object) and its non-persistent names."""

    module: torch.nn.Module
    slots: dict[str, dict[str, torch.Tensor | None]]
    non_persistent: set[str]

    @classmethod
    def of(cls, module: torch.nn.Module) -> _ModuleSlots:
        slots = {kind: dict(getattr(module, kind)) for kind in _SLOT_KINDS}
        return cls(module, slots, set(module._non_persistent_buffers_set))

    def restore(self) -> None:
        """The saved objects back under their names, in their order; names added since are dropped."""
        for kind, saved in self.slots.items():
            current = getattr(self.module, kind)
            current.clear()
            current.update(saved)
        names = self.module._non_persistent_buffers_set
        names.clear()
        names.update(self.non_persistent)


def _save_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    state = {}
    for param, entries in optimizer.state.items():
        state[param] = {
            key: (value.device, _host_copy(value)) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            for key, value in entries.items()
        }
    groups = [
        {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
    return state, groups


def _restore_optimizer(optimizer: torch.optim.Optimizer, state: dict, groups: list[dict]) -> None:
    for param in [p for p in optimizer.state if p not in state]:
        del optimizer.state[param]
    for param, saved_entries in state.items():
        current = optimizer.state[param]
        for key in [k for k in current if k not in saved_entries]:
            del current[key]
        for key, saved in saved_entries.items():
            if isinstance(saved, tuple):
                device, value = saved
                current[key] = _put_back(current.get(key), value, device)
            else:
                current[key] = copy.deepcopy(saved)
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        group.update(copy.deepcopy(saved_group))


def save_rng() -> dict[str, Any]:
    """Every random number generator a step may draw from: torch (and CUDA's), Python's and numpy's."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        rng["mps"] = torch.mps.get_rng_state()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Put back the generators ``save_rng`` took."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "mps" in rng:
        torch.mps.set_rng_state(rng["mps"])


def _fsdp_modules(model: torch.nn.Module) -> list[Any]:
    """The modules of ``model`` that ``fully_shard`` made FSDP2 modules (none while FSDP2 was never imported)."""
    module_class = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if module_class is None:
        return []
    return [module for module in model.modules() if isinstance(module, module_class)]


def reset_sharded_iteration(model: torch.nn.Module) -> None:
    """Bring every FSDP2 module of ``model`` to rest, as a finished training step leaves it: no
    iteration in flight, every parameter group sharded (its gathered copy freed), no gradient of a
    cut-short backward held (also the root's gathered parameters a no-grad forward keeps). Nothing
    for a model without FSDP2 modules.

    torch's own recovery after an exception in forward or backward does most of it:
    ``FSDPModule.reset_iter_state()`` on each root (a module whose ``FSDPState._is_root`` lazy
    initialisation set; torch/distributed/fsdp/_fully_shard/_fully_shard.py, torch 2.13). Its
    ``FSDPState._reset_iter_state`` (_fsdp_state.py) waits on and drops the all-gather and
    reduce-scatter state in flight, clears ``iter_forward_root``, ``_modules_to_run_forward``,
    ``post_forward_order`` and ``post_backward_final_callback_queued`` (else the next backward
    never queues its final callback), sets every state's and group's training state to IDLE, and
    reshards each group (``FSDPParamGroup._reset_iter_state``: ``_to_sharded()``, which puts the
    shards back in the module slots and frees the gathered storages). Two things it leaves are put
    right on each ``FSDPParam`` (_fsdp_param.py): the gathered storages of a group still marked
    sharded, whose all-gather copy-out ran out of memory part-way (``_to_sharded`` frees only a
    group marked unsharded; ``free_unsharded_param()`` frees all, a no-op on a freed one), and the
    gradient autograd left on the gathered parameter when backward stopped before the group's
    post-backward hook (``_unsharded_param.grad``, ``unsharded_accumulated_grad``): dropped, as
    the failed iteration's gradients are.
    """
    modules = _fsdp_modules(model)
    states = {id(state): state for state in (module._get_fsdp_state() for module in modules)}  # shared by a group
    for module in modules:
        if module._get_fsdp_state()._is_root:  # None before the first forward: no iteration ran
            module.reset_iter_state()
    for state in states.values():
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                param.free_unsharded_param()
                param.unsharded_accumulated_grad = None
                if hasattr(param, "_unsharded_param"):  # made by the first all-gather
                    param._unsharded_param.grad = None


@dataclass
class StateSnapshot:
    """A host-memory copy of a model's and optimizer's state; ``restore()`` puts it back bitwise.

    >>> model = torch.nn.Linear(2, 2)
    >>> snapshot = StateSnapshot.take(model)
    >>> _ = model.weight.data.add_(1.0)
    >>> snapshot.restore()

    A tensor reassigned on the module (as a ``forward`` may do) is put back by name:

    >>> norm = torch.nn.BatchNorm1d(2)
    >>> mean = norm.running_mean
    >>> snapshot = StateSnapshot.take(norm)
    >>> norm.running_mean = mean + 1
    >>> snapshot.restore()
    >>> norm.running_mean is mean, norm.running_mean.tolist()
    (True, [0.0, 0.0])
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    tensors: list[_SavedTensor] = field(default_factory=list)
    slots: list[_ModuleSlots] = field(default_factory=list)
    grads: list[tuple[torch.Tensor, tuple[torch.device, torch.Tensor] | None]] = field(default_factory=list)
    training: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    optimizer_state: dict = field(default_factory=dict)
    optimizer_groups: list[dict] = field(default_factory=list)
    rng: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def take(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateSnapshot:
        snapshot = cls(model, optimizer)
        params = list(model.parameters())
        snapshot.tensors = [_SavedTensor.of(t) for t in [*params, *model.buffers()]]
        snapshot.slots = [_ModuleSlots.of(module) for module in model.modules()]
        # Only the gradient's place and host copy: holding the tensor itself would pin its
        # device memory for as long as the snapshot lives.
        snapshot.grads = [(p, None if p.grad is None else (p.grad.device, _host_copy(p.grad))) for p in params]
        snapshot.training = [(module, module.training) for module in model.modules()]
        if optimizer is not None:
            snapshot.optimizer_state, snapshot.optimizer_groups = _save_optimizer(optimizer)
        snapshot.rng = save_rng()
        return snapshot

    def restore(self) -> None:
        """Put everything back as it was when the snapshot was taken (an FSDP2 model brought to rest
        first, see ``reset_sharded_iteration``)."""
        reset_sharded_iteration(self.model)
        for module_slots in self.slots:  # first the objects back in their slots, then their values
            module_slots.restore()
        with torch.no_grad():
            for saved in self.tensors:
                saved.tensor.copy_(saved.value)
        for param, saved_grad in self.grads:
            param.grad = None if saved_grad is None else _put_back(param.grad, saved_grad[1], saved_grad[0])
        for module, training in self.training:
            module.training = training
        if self.optimizer is not None:
            _restore_optimizer(self.optimizer, self.optimizer_state, self.optimizer_groups)
        restore_rng(self.rng)
