"""SimulatedDevice: real CPU compute against a memory capacity you choose."""

from __future__ import annotations

import torch

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.base import CountingDevice
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes

CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator rounds every block up to 512 bytes


class SimulatedDevice(CountingDevice):
    """A stand-in for a GPU: the step runs for real on the CPU and every live tensor byte counts.

    Parameters, buffers, gradients, optimizer state, the batch, activations and temporaries all
    count against ``capacity`` (an int in bytes, or a string such as ``"512MiB"``); an allocation
    past it raises ``torch.OutOfMemoryError``. Deterministic, so it is the test bed for everything.

    >>> device = SimulatedDevice("64MiB")
    >>> device.capacity_bytes()
    67108864
    """

    simulated = True

    def __init__(self, capacity: int | str, *, rounding_bytes: int = CUDA_BLOCK_BYTES):
        self._capacity_bytes = parse_bytes(capacity)
        name = f"sim:{format_bytes(self._capacity_bytes).replace(' ', '')}"
        counter = LiveBytes(limit_bytes=self._capacity_bytes, rounding_bytes=rounding_bytes, name=name)
        super().__init__(name, torch.device("cpu"), counter)

    def capacity_bytes(self) -> int:
        return self._capacity_bytes
