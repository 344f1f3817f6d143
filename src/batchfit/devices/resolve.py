"""Turn what the user wrote (``None``, ``"cuda:1"``, ``"sim:8GiB"``, a Device) into a Device."""

from __future__ import annotations

import torch

from batchfit.devices.base import Device
from batchfit.devices.cpu import CpuDevice
from batchfit.devices.cuda import CudaDevice
from batchfit.devices.mps import MpsDevice
from batchfit.devices.presets import refuse_preset
from batchfit.devices.simulated import SimulatedDevice
from batchfit.errors import InputError
from batchfit.errors import InputTypeError

DEVICE_HELP = (
    "use 'auto', 'cpu', 'cuda', 'cuda:N', 'mps', 'sim:CAPACITY' (e.g. 'sim:8GiB'; 'sim:8GiB:cuda' models the CUDA "
    "caching allocator, 'sim:8GiB:cuda-expandable' with expandable segments) or a batchfit Device"
)
DEFAULT_SIMULATED_CAPACITY = "256MiB"  # small enough that a demo on two CPU cores takes seconds


def auto_device(simulated_capacity: int | str = DEFAULT_SIMULATED_CAPACITY) -> Device:
    """A GPU if there is one (CUDA, then MPS), else a simulated device of ``simulated_capacity``."""
    if torch.cuda.is_available():
        return CudaDevice()
    if torch.backends.mps.is_available():
        return MpsDevice()
    return SimulatedDevice(simulated_capacity)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model already is (as the classic recipe reads it: ``next(model.parameters()).device``)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def from_torch_device(device: torch.device) -> Device:
    """The batchfit Device for a ``torch.device``."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"CUDA is not available on this machine: {DEVICE_HELP}")
        return CudaDevice(device.index)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise InputError(f"MPS is not available on this machine: {DEVICE_HELP}")
        return MpsDevice()
    if device.type == "cpu":
        return CpuDevice()
    raise InputError(f"device type {device.type!r} is not supported yet: {DEVICE_HELP}")


def from_string(spec: str) -> Device:
    """Parse ``"auto"``, ``"cpu"``, ``"cuda:0"``, ``"mps"``, ``"sim:8GiB"`` or ``"sim:8GiB:cuda"``."""
    text = spec.strip()
    if text.lower() == "auto":
        return auto_device()
    if text.lower().startswith("sim:"):
        capacity, _, allocator = text[4:].partition(":")
        return SimulatedDevice(capacity, allocator=allocator or "exact")
    refuse_preset(text)
    try:
        device = torch.device(text)
    except RuntimeError:
        raise InputError(f"unknown device {spec!r}: {DEVICE_HELP}") from None
    return from_torch_device(device)


def resolve_device(spec: Device | torch.device | str | None, model: torch.nn.Module) -> Device:
    """The Device to probe on; ``None`` means where the model already is."""
    if spec is None:
        return from_torch_device(model_device(model))
    if isinstance(spec, str):
        return from_string(spec)
    if isinstance(spec, torch.device):
        return from_torch_device(spec)
    if isinstance(spec, Device):
        return spec
    raise InputTypeError(
        f"device must be a string, a torch.device or a batchfit Device, got {type(spec).__name__}: {DEVICE_HELP}"
    )
