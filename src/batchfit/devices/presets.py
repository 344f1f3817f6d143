"""Common accelerators and the memory a training process can use on them.

Memory sizes are the vendors' nominal capacities (HBM and GDDR capacities are binary, so
"40GB" is 40 GiB); drivers report a little less where ECC or firmware reserve some. From that,
each CUDA preset subtracts a per-process reserve for what tensors never see:

- the CUDA context: 287,047,680 bytes measured with lazy module loading, PyTorch's default
  since 1.13 (pytorch/pytorch#86509; 666,632,192 bytes with eager loading), and
- cuBLASLt's workspace: up to 32 MiB on Hopper, 4 MiB elsewhere (pytorch/pytorch#120925).

Apple's unified memory is shared with the system; Metal recommends a working set of roughly
three quarters of it (an approximation: ``MpsDevice`` reads the real figure on the machine).
Override any reserve with ``reserve_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.errors import InputError

GIB = 2**30
CUDA_RESERVE_BYTES = 287_047_680 + 32 * 2**20  # context (lazy loading) + the largest cuBLASLt workspace
APPLE_WORKING_SET_FRACTION = 0.75


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: its memory and the part a process cannot use for tensors."""

    name: str
    label: str
    memory_bytes: int
    reserve_bytes: int

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


def _cuda(name: str, label: str, gib: int) -> Accelerator:
    return Accelerator(name, label, gib * GIB, CUDA_RESERVE_BYTES)


def _apple(gib: int) -> Accelerator:
    memory = gib * GIB
    return Accelerator(
        f"apple-{gib}gb",
        f"Apple M-series, {gib} GB unified memory",
        memory,
        int(memory * (1 - APPLE_WORKING_SET_FRACTION)),
    )


ACCELERATORS: dict[str, Accelerator] = {
    accelerator.name: accelerator
    for accelerator in [
        _cuda("t4-16gb", "NVIDIA T4 16GB", 16),
        _cuda("v100-16gb", "NVIDIA V100 16GB", 16),
        _cuda("v100-32gb", "NVIDIA V100 32GB", 32),
        _cuda("rtx3060-12gb", "NVIDIA GeForce RTX 3060 12GB", 12),
        _cuda("rtx3090-24gb", "NVIDIA GeForce RTX 3090 24GB", 24),
        _cuda("rtx4090-24gb", "NVIDIA GeForce RTX 4090 24GB", 24),
        _cuda("l4-24gb", "NVIDIA L4 24GB", 24),
        _cuda("a10-24gb", "NVIDIA A10 24GB", 24),
        _cuda("l40s-48gb", "NVIDIA L40S 48GB", 48),
        _cuda("a100-40gb", "NVIDIA A100 40GB", 40),
        _cuda("a100-80gb", "NVIDIA A100 80GB", 80),
        _cuda("h100-80gb", "NVIDIA H100 80GB", 80),
        _cuda("h200-141gb", "NVIDIA H200 141GB", 141),
        _cuda("mi300x-192gb", "AMD Instinct MI300X 192GB", 192),  # ROCm: its context differs; same reserve as a start
        *[_apple(gib) for gib in (8, 16, 24, 32, 36, 48, 64, 96, 128, 192)],
    ]
}


def _normalized(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def is_preset(name: str) -> bool:
    return _normalized(name) in ACCELERATORS


def preset(name: str) -> Accelerator:
    """The accelerator called ``name`` (``"a100-40gb"``, ``"H100-80GB"``, ``"apple-64gb"``).

    >>> preset("A100-40GB").usable_bytes / 2**30 > 39.6
    True
    """
    key = _normalized(name)
    if key not in ACCELERATORS:
        raise InputError(
            f"unknown GPU {name!r}: choose one of {', '.join(ACCELERATORS)}, or give a capacity like '40GiB'"
        )
    return ACCELERATORS[key]


def usable_bytes(name: str, reserve_bytes: int | None = None) -> int:
    """Usable memory of a preset, with its default reserve or ``reserve_bytes``."""
    accelerator = preset(name)
    reserve = accelerator.reserve_bytes if reserve_bytes is None else reserve_bytes
    if not 0 <= reserve < accelerator.memory_bytes:
        raise InputError(f"reserve_bytes must be in [0, {accelerator.memory_bytes}), got {reserve}")
    return accelerator.memory_bytes - reserve
