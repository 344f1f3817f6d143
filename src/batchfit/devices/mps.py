"""MpsDevice: Apple silicon through Metal. MPS has no peak statistic, so peaks are counted."""

from __future__ import annotations

import gc

import torch

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.base import CountingDevice


class MpsDevice(CountingDevice):
    """Probe on ``mps``; capacity is Metal's recommended working-set size."""

    def __init__(self) -> None:
        super().__init__("mps", torch.device("mps"), LiveBytes(name="mps"))

    def capacity_bytes(self) -> int:
        return int(torch.mps.recommended_max_memory())

    def cleanup(self) -> None:
        gc.collect(1)
        torch.mps.empty_cache()

    def synchronize(self) -> None:
        torch.mps.synchronize()
