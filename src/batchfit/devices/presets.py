"""Common accelerators and the memory a training process can use on them.

A CUDA preset starts from the total its card's driver reports (``torch.cuda.get_device_properties(i)
.total_memory``, which PyTorch's out-of-memory message prints as "GPU 0 has a total capacity of X GiB"): less
than the nominal capacity ("80GB" is not 80 GiB; ECC, firmware and the driver keep some), and it moves with the
driver by tens to hundreds of MiB. Each figure below is the one measured on the card where batchfit measured one,
else the lowest recent Linux reading found in public reports, cited beside it. From that total each preset
subtracts:

- CUDA's start-up: the context and what the driver keeps, ``total - (free + reserved)`` right after the first
  bf16 matmul: 623,706,112 bytes measured on an H100 80GB HBM3 and 554,500,096 on an H200 (2026-11, driver
  580.159.04, torch 2.11). Cards not measured take the H100's figure, the larger: the context grows with the
  number of multiprocessors (pytorch/pytorch#107667 puts it at 300-400 MB), so it is on the safe side for
  smaller cards.

What the process then allocates through the caching allocator is the trace's to count: a trace for a CUDA
preset counts cuBLAS's workspaces and the attention kernels' scratch (``batchfit.devices.cuda_kernels``).

Apple's unified memory is shared with the system; Metal recommends a working set of roughly
three quarters of it (an approximation: ``MpsDevice`` reads the real figure on the machine).
Override any reserve with ``reserve_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.errors import InputError

GIB = 2**30
MIB = 2**20
STARTUP_BYTES = 623_706_112  # measured on an H100 80GB HBM3: total - (free + reserved) after one bf16 matmul
CUDA_RESERVE_BYTES = STARTUP_BYTES  # a card's reserve where its start-up was not measured
APPLE_WORKING_SET_FRACTION = 0.75


@dataclass(frozen=True)
class Accelerator:
    """One accelerator: the memory its driver reports, the part a process cannot use for tensors, and where
    the total comes from."""

    name: str
    label: str
    memory_bytes: int
    reserve_bytes: int
    source: str = ""
    compute_capability: tuple[int, int] | None = None  # a CUDA card's: which kernels a trace for it runs

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes


def _cuda(
    name: str, label: str, sm: tuple[int, int], total_bytes: int, source: str, startup_bytes: int = STARTUP_BYTES
) -> Accelerator:
    return Accelerator(name, label, total_bytes, startup_bytes, source, sm)


def _apple(gib: int) -> Accelerator:
    memory = gib * GIB
    return Accelerator(
        f"apple-{gib}gb",
        f"Apple M-series, {gib} GB unified memory",
        memory,
        int(memory * (1 - APPLE_WORKING_SET_FRACTION)),
        "nominal unified memory; Metal's recommended working set is about three quarters",
    )


# Driver-reported totals (bytes). Where a source only prints GiB to two decimals, the figure is the low end of
# what it implies, rounded down to whole MiB.
ACCELERATORS: dict[str, Accelerator] = {
    accelerator.name: accelerator
    for accelerator in [
        _cuda(
            "t4-16gb",
            "NVIDIA T4 16GB",
            (7, 5),
            14904 * MIB,
            "14.56 GiB on 535 drivers, ECC on (hpcaitech/Open-Sora#697)",
        ),
        _cuda("v100-16gb", "NVIDIA V100 16GB", (7, 0), 16_935_682_048, "15.77 GiB, SXM2 and PCIe (openxla/xla specs)"),
        _cuda("v100-32gb", "NVIDIA V100 32GB", (7, 0), 32496 * MIB, "31.74 GiB (liucongg/ChatGLM-Finetuning#73)"),
        _cuda("rtx3060-12gb", "NVIDIA GeForce RTX 3060 12GB", (8, 6), 12_629_508_096, "11.76 GiB, headless Linux"),
        _cuda(
            "rtx3090-24gb", "NVIDIA GeForce RTX 3090 24GB", (8, 6), 25_286_672_384, "23.55 GiB (pytorch/pytorch#54564)"
        ),
        _cuda(
            "rtx4090-24gb", "NVIDIA GeForce RTX 4090 24GB", (8, 9), 25_386_352_640, "23.64 GiB, Linux (RLinf/RLinf#255)"
        ),
        _cuda("l4-24gb", "NVIDIA L4 24GB", (8, 9), 23_612_293_120, "21.99 GiB, ECC on (ArcInstitute/evo2#190)"),
        _cuda("a10-24gb", "NVIDIA A10 24GB", (8, 6), 23_609_475_072, "21.99 GiB on R535 (zai-org/CogVLM#236)"),
        _cuda("l40s-48gb", "NVIDIA L40S 48GB", (8, 9), 47_576_711_168, "44.31 GiB, ECC on (vladmandic/sdnext#3656)"),
        _cuda("a100-40gb", "NVIDIA A100 40GB", (8, 0), 40320 * MIB, "39.38 GiB, PCIe (vllm-project/vllm#16570)"),
        _cuda("a100-80gb", "NVIDIA A100 80GB", (8, 0), 81049 * MIB, "79.15 GiB, PCIe (ekondis/mixbench#47)"),
        _cuda(
            "h100-80gb",
            "NVIDIA H100 80GB",
            (9, 0),
            85_017_493_504,
            "measured on an H100 80GB HBM3 (2026-11); public readings 79.11-79.22 GiB",
            startup_bytes=623_706_112,
        ),
        _cuda(
            "h200-141gb",
            "NVIDIA H200 141GB",
            (9, 0),
            150_109_880_320,
            "measured on an H200 (2026-11); public readings 139.72-139.81 GiB",
            startup_bytes=554_500_096,
        ),
        # ROCm: its start-up differs (the CUDA figure stands in until measured); its attention kernels, AOTriton's
        # flash and memory-efficient ones and no cuDNN, follow the sm90 rules
        _cuda("mi300x-192gb", "AMD Instinct MI300X 192GB", (9, 4), 206_141_652_992, "191.98 GiB (pytorch/ao#2853)"),
        *[_apple(gib) for gib in (8, 16, 24, 32, 36, 48, 64, 96, 128, 192)],
    ]
}


def _normalized(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def is_preset(name: str) -> bool:
    return _normalized(name) in ACCELERATORS


def preset(name: str) -> Accelerator:
    """The accelerator called ``name`` (``"a100-40gb"``, ``"H100-80GB"``, ``"apple-64gb"``).

    >>> round(preset("A100-40GB").usable_bytes / 2**30, 2), preset("h100-80gb").usable_bytes
    (38.79, 84393787392)
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


def refuse_preset(spec: str) -> None:
    """A GPU preset is not a device to run on: one line naming what traces for it.

    >>> refuse_preset("cuda:0")
    >>> refuse_preset("a100-40gb")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: a100-40gb is a GPU preset: nothing runs on it, a trace estimates it: ...
    """
    if is_preset(spec.strip()):
        raise InputError(
            f"{spec} is a GPU preset: nothing runs on it, a trace estimates it: on the command line --gpu {spec} "
            f"(batchfit estimate, batchfit plan), in Python device=batchfit.TraceDevice({spec.strip()!r})"
        )
