"""SimulatedDevice: real CPU compute against a memory capacity you choose."""

from __future__ import annotations

import math
import time

import torch

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.accounting import local_tensors
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.allocator_settings import allocator_label
from batchfit.devices.allocator_settings import resolve_allocator
from batchfit.devices.base import CountingDevice
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block up to 512 bytes


class SimulatedDevice(CountingDevice):
    """A stand-in for a GPU: the step runs for real on the CPU and every live tensor byte counts.

    Parameters, buffers, gradients, optimizer state, the batch, activations and temporaries all
    count against ``capacity`` (an int in bytes, or a string such as ``"512MiB"``); an allocation
    past it raises ``torch.OutOfMemoryError``. Deterministic, so it is the test bed for everything.

    ``step_seconds`` makes every training step that completes cost that many more seconds of
    wall time (a sleep in ``synchronize()``, which a trial calls once after each step), the same
    at every batch size: the regime of a large model on a GPU, where a real trial costs seconds.
    A step that ends in an out-of-memory error costs nothing extra.

    ``allocator`` says what decides a fit: ``"exact"`` (default), the live bytes within the capacity;
    ``"cuda"``, PyTorch's CUDA caching allocator modelled (``batchfit.devices.caching_allocator``) with this
    process's ``PYTORCH_CUDA_ALLOC_CONF``: a request fails where the card's allocator could not serve it,
    fragmentation included, and trials report reserved peaks; ``"cuda-expandable"``, the same with
    ``expandable_segments:True``; or an ``AllocatorSettings``.

    >>> device = SimulatedDevice("64MiB")
    >>> device.capacity_bytes(), device.name
    (67108864, 'sim:64.0MiB')
    >>> SimulatedDevice("64MiB", step_seconds=0.5).step_seconds
    0.5
    >>> SimulatedDevice("64MiB", allocator="cuda-expandable").name
    'sim:64.0MiB:cuda-expandable'
    """

    simulated = True

    def __init__(
        self,
        capacity: int | str,
        *,
        rounding_bytes: int = CUDA_BLOCK_BYTES,
        step_seconds: float = 0.0,
        allocator: str | AllocatorSettings | None = "exact",
    ):
        self.step_seconds = check_step_seconds(step_seconds)
        self._capacity_bytes = parse_bytes(capacity)
        self.allocator_settings = resolve_allocator(allocator)
        name = f"sim:{format_bytes(self._capacity_bytes).replace(' ', '')}"
        if self.allocator_settings is not None:
            name += f":{allocator_label(self.allocator_settings)}"
        counter = LiveBytes(
            limit_bytes=self._capacity_bytes,
            rounding_bytes=rounding_bytes,
            name=name,
            allocator=modelled_allocator(self._capacity_bytes, self.allocator_settings),
        )
        super().__init__(name, torch.device("cpu"), counter)

    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def for_workload(self, workload: object) -> SimulatedDevice:
        """This device, once the host is known to have the memory its trials may really take: the
        capacity, and the host copy of the model's and optimizer's state a trial keeps to restore
        them (outside the capacity). More than the host can give would make a search a threat to
        the machine (the OOM killer, or swapping), so it is refused in one line naming the fix."""
        check_host_has(self._capacity_bytes + state_copy_bytes(workload), self.name)
        return self

    def synchronize(self) -> None:
        """Wait for the step to finish: ``step_seconds`` of simulated compute (none by default)."""
        if self.step_seconds:
            time.sleep(self.step_seconds)


def modelled_allocator(capacity_bytes: int, settings: AllocatorSettings | None) -> CachingAllocator | None:
    """The caching allocator a simulated device of ``capacity_bytes`` models (``None``: counted exactly)."""
    return CachingAllocator(capacity_bytes, settings) if settings is not None else None


def state_copy_bytes(workload: object) -> int:
    """The bytes a trial's state snapshot copies to the host: ``workload``'s model's parameters and
    buffers (this rank's shards of sharded ones) and its optimizer's state; 0 without a model.

    >>> from batchfit.step.workload import Workload
    >>> state_copy_bytes(Workload(torch.nn.Linear(4, 2), torch.zeros(1, 4), loss_fn=lambda out, batch: out.sum()))
    40
    """
    model = getattr(workload, "model", None)
    if not isinstance(model, torch.nn.Module):
        return 0
    optimizer = getattr(workload, "optimizer", None)
    state = [v for s in (optimizer.state.values() if optimizer is not None else ()) for v in s.values()]
    tensors = [*model.parameters(), *model.buffers(), *(v for v in state if isinstance(v, torch.Tensor))]
    return sum(t.numel() * t.element_size() for tensor in tensors for t in local_tensors(tensor))


HOST_SHARE = 0.8  # a simulated capacity may use at most this share of the host's available memory


def check_host_has(capacity_bytes: int, name: str, available_bytes: int | None = None) -> None:
    """An ``InputError`` when ``capacity_bytes`` of real tensors would not fit in ``HOST_SHARE`` of
    the memory the host can still give (``available_bytes``, read from the host when ``None``).

    >>> check_host_has(2**40, "sim:1.0TiB", available_bytes=2**34)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: sim:1.0TiB would need up to ... which has 16.0 GiB available: give a smaller ...
    """
    if available_bytes is None:
        from batchfit.devices.cpu import available_host_bytes

        available_bytes = available_host_bytes()
    if available_bytes is None or capacity_bytes <= HOST_SHARE * available_bytes:
        return
    wanted = format_bytes(capacity_bytes)
    raise InputError(
        f"{name} would need up to {wanted} of this host's memory, which has {format_bytes(available_bytes)} "
        f"available: give a smaller sim: capacity (at most {format_bytes(int(HOST_SHARE * available_bytes))} here), "
        f"or estimate on fake tensors, which allocate nothing (batchfit estimate --capacity {wanted.replace(' ', '')}, "
        "or TraceDevice)"
    )


def check_step_seconds(step_seconds: object) -> float:
    """``step_seconds`` as a float: a finite number of seconds, zero or more.

    >>> check_step_seconds(1)
    1.0
    """
    if isinstance(step_seconds, bool) or not isinstance(step_seconds, (int, float)):
        raise InputTypeError(f"step_seconds must be a number of seconds such as 0.5, got {type(step_seconds).__name__}")
    if not math.isfinite(step_seconds) or step_seconds < 0:
        raise InputError(f"step_seconds must be a finite number of seconds, 0 or more, got {step_seconds!r}")
    return float(step_seconds)
