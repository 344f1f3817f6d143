"""Fault injection for the reliability campaign: raise an error at operator number k of a search.

``FaultyDevice`` is a ``SimulatedDevice`` whose ``measuring()`` block (the real trials, never the
fake-tensor trace) also runs an ``Injector``: a ``TorchDispatchMode`` above the device's own
accounting that counts every op (forward, backward and optimizer ops alike) and, when armed with a
``Fault``, raises it at op ``k``, before the op runs or just after it (its output still alive in
the raising frame, as in a user's function that fails with tensors in hand).

Each op is labelled with the phase it belongs to, independently of batchfit's own bookkeeping:
``batch`` (building the batch), ``forward`` (from the model's first forward call, loss included),
``backward`` (from ``Tensor.backward``, its seed gradient included, through the ops the autograd
engine runs) and ``optimizer`` (from the return of ``Tensor.backward``, so ``optimizer.step``'s
profiler op counts, to the next forward). The labels come from a
global module forward pre-hook, a global optimizer step pre-hook and a wrapper around
``torch.Tensor.backward`` (all installed only inside ``phase_hooks()``), and from
``torch._C._current_graph_task_id``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np
import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

import batchfit as bf
from batchfit.step.workload import compute_loss

PHASES = ("batch", "forward", "backward", "optimizer")
OOM_KINDS = ("oom", "oom-message")  # torch.OutOfMemoryError, and a CUDA OOM message in a RuntimeError
OTHER_KINDS = ("runtime", "value", "user", "interrupt")
KINDS = OOM_KINDS + OTHER_KINDS


class UserBug(Exception):
    """An error of the user's own type, raised from inside the step."""


@dataclass
class Fault:
    """Raise a ``kind`` error at op ``op_index`` of the armed run, ``after`` the op ran or before it."""

    kind: str
    op_index: int
    after: bool
    marker: str
    error: BaseException | None = None

    @property
    def is_oom(self) -> bool:
        return self.kind in OOM_KINDS

    def make(self) -> BaseException:
        """The error to raise. Only one that must come out of the search is kept (to check it is
        the same object): holding an OOM would keep the failed trial's frames, and with them its
        activations, alive for the rest of the search."""
        text = f"{self.marker} at op {self.op_index}"
        error = {
            "oom": lambda: torch.OutOfMemoryError(f"{text}: CUDA out of memory. Tried to allocate 2.00 MiB"),
            "oom-message": lambda: RuntimeError(f"{text}: CUDA out of memory. Tried to allocate 2.00 MiB"),
            "runtime": lambda: RuntimeError(f"{text}: CUDA error: device-side assert triggered"),
            "value": lambda: ValueError(f"{text}: a bad value inside the step"),
            "user": lambda: UserBug(f"{text}: the user's own bug"),
            "interrupt": lambda: KeyboardInterrupt(text),
        }[self.kind]()
        if not self.is_oom:
            self.error = error
        return error


@dataclass
class Injector:
    """Counts the ops of real trials, labels their phase, and raises an armed ``Fault`` at its op."""

    measuring: bool = False
    phase: str = "batch"
    count: int = 0
    labels: list[str] = field(default_factory=list)  # the phase of every op since reset() (recording)
    completed: list[bool] = field(default_factory=list)  # whether each op returned
    fault: Fault | None = None
    fired_phase: str | None = None
    recording: bool = False

    def reset(self, fault: Fault | None = None, recording: bool = False) -> None:
        self.count, self.labels, self.completed = 0, [], []
        self.fault, self.fired_phase, self.recording = fault, None, recording

    def op_phase(self) -> str:
        return "backward" if torch._C._current_graph_task_id() >= 0 else self.phase

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.measuring, self.phase = True, "batch"
        try:
            with _InjectMode(self):
                yield
        finally:
            self.measuring = False

    def before_op(self) -> int:
        index, self.count = self.count, self.count + 1
        if self.recording:
            self.labels.append(self.op_phase())
            self.completed.append(False)
        if self.fault is not None and index == self.fault.op_index and not self.fault.after:
            self._fire()
        return index

    def after_op(self, index: int) -> None:
        if self.recording:
            self.completed[index] = True
        if self.fault is not None and index == self.fault.op_index and self.fault.after:
            self._fire()

    def _fire(self) -> None:
        assert self.fault is not None and self.fired_phase is None, "a fault fires once"
        self.fired_phase = self.op_phase()
        raise self.fault.make()


class _InjectMode(TorchDispatchMode):
    def __init__(self, injector: Injector):
        super().__init__()
        self.injector = injector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        index = self.injector.before_op()
        out = func(*args, **(kwargs or {}))  # alive in this frame when the fault fires after the op
        self.injector.after_op(index)
        return out


class FaultyDevice(bf.SimulatedDevice):
    """A ``SimulatedDevice`` whose real trials run under an ``Injector`` (the trace never does)."""

    def __init__(self, capacity: int | str, injector: Injector):
        super().__init__(capacity)
        self.injector = injector

    @contextlib.contextmanager
    def measuring(self, uncounted: Any = ()) -> Iterator[None]:
        with super().measuring(uncounted), self.injector.active():
            yield


@contextlib.contextmanager
def phase_hooks(injector: Injector) -> Iterator[None]:
    """Global hooks that move ``injector.phase`` to forward, backward and optimizer while a trial runs."""

    def forward(module: torch.nn.Module, args: Any) -> None:
        if injector.measuring:
            injector.phase = "forward"

    def step_started(optimizer: Any, args: Any, kwargs: Any) -> None:
        if injector.measuring:
            injector.phase = "optimizer"

    def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if injector.measuring:
            injector.phase = "backward"  # from the seed gradient (``ones_like``) on, before the engine starts
        try:
            return tensor_backward(tensor, *args, **kwargs)
        finally:
            if injector.measuring:
                injector.phase = "optimizer"  # what follows backward: the step (its profiler op comes before its hooks)

    handles = [register_module_forward_pre_hook(forward), register_optimizer_step_pre_hook(step_started)]
    tensor_backward, torch.Tensor.backward = torch.Tensor.backward, backward
    try:
        yield
    finally:
        torch.Tensor.backward = tensor_backward
        for handle in handles:
            handle.remove()


# -- the state a search must leave bitwise as it found it -----------------------------------------


def train_a_little(work: bf.Workload, rng: random.Random) -> None:
    """Give the state something to lose: optimizer steps taken, grads left populated, BatchNorm
    statistics moved, a mixed train/eval model and RNG streams advanced."""
    for _ in range(2):
        work.optimizer.zero_grad()
        compute_loss(work.model, work.sample_batch, loss_fn=work.loss_fn, step_fn=work.step_fn).backward()
        work.optimizer.step()
    compute_loss(work.model, work.sample_batch, loss_fn=work.loss_fn, step_fn=work.step_fn).backward()
    for index, module in enumerate(work.model.modules()):
        if index % 2 == 1:
            module.eval()
    torch.rand(rng.randint(1, 5))
    np.random.rand(rng.randint(1, 5))
    random.random()  # the global stream: the search must leave it where it was


def _bits(tensor: torch.Tensor) -> tuple[Any, ...]:
    flat = tensor.detach().contiguous().reshape(-1)
    return (tensor.dtype, tuple(tensor.shape), tensor.device, tensor.requires_grad, flat.view(torch.uint8).clone())


def _value(value: Any) -> Any:
    return _bits(value) if isinstance(value, torch.Tensor) else value


def _numpy_rng() -> tuple[Any, ...]:
    name, keys, position, has_gauss, cached = np.random.get_state()
    return name, keys.tobytes(), position, has_gauss, cached


def fingerprint(work: bf.Workload) -> dict[str, Any]:
    """Everything a search must restore, bitwise: tensors, grads, optimizer state and groups, the
    train/eval flags, the RNG streams, and which objects the model and optimizer hold."""
    model, optimizer = work.model, work.optimizer
    params = list(model.parameters())
    return {
        "parameters": [_bits(p) for p in params],
        "buffers": [_bits(b) for b in model.buffers()],
        "grads": [None if p.grad is None else _bits(p.grad) for p in params],
        "identity": [id(t) for t in [*params, *model.buffers()]],
        "optimizer params": [[id(p) for p in group["params"]] for group in optimizer.param_groups],
        "optimizer state": [
            {key: _value(value) for key, value in optimizer.state[p].items()} if p in optimizer.state else None
            for p in params
        ],
        "optimizer groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "training": [m.training for m in model.modules()],
        "rng torch": _bits(torch.get_rng_state()),
        "rng python": random.getstate(),
        "rng numpy": _numpy_rng(),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The parts of the state that differ (empty: bitwise the same)."""
    return [key for key in before if not _same(before[key], after[key])]
