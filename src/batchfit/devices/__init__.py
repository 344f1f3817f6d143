"""Devices: where a probe runs and how memory is read, behind one protocol (CPU, CUDA, MPS, the
simulated device that counts every live tensor byte on the CPU, and the trace device that does the
same on fake tensors); the out-of-memory classifier and the clean-up after one; byte units.

May import ``step`` and ``errors``; never ``search`` or anything above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "Device": "batchfit.devices.base",
        "CpuDevice": "batchfit.devices.cpu",
        "CudaDevice": "batchfit.devices.cuda",
        "MpsDevice": "batchfit.devices.mps",
        "is_oom": "batchfit.devices.oom",
        "model_device": "batchfit.devices.resolve",
        "resolve_device": "batchfit.devices.resolve",
        "SimulatedDevice": "batchfit.devices.simulated",
    },
)

if TYPE_CHECKING:
    from batchfit.devices.base import Device
    from batchfit.devices.cpu import CpuDevice
    from batchfit.devices.cuda import CudaDevice
    from batchfit.devices.mps import MpsDevice
    from batchfit.devices.oom import is_oom
    from batchfit.devices.resolve import model_device
    from batchfit.devices.resolve import resolve_device
    from batchfit.devices.simulated import SimulatedDevice

__all__ = [
    "CpuDevice",
    "CudaDevice",
    "Device",
    "MpsDevice",
    "SimulatedDevice",
    "is_oom",
    "model_device",
    "resolve_device",
]
