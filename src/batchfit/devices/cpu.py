"""CpuDevice: the host itself; peaks read by live-bytes accounting, OOM from the real allocator."""

from __future__ import annotations

import os

import torch

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.base import CountingDevice


def available_host_bytes() -> int | None:
    """Memory the host can still give (``MemAvailable`` on Linux, else physical memory)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class CpuDevice(CountingDevice):
    """Probe on the CPU. Capacity is the host's available memory at creation."""

    def __init__(self) -> None:
        super().__init__("cpu", torch.device("cpu"), LiveBytes(name="cpu"))
        self._capacity_bytes = available_host_bytes()

    def capacity_bytes(self) -> int | None:
        return self._capacity_bytes
