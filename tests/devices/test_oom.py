"""One OOM classifier: every backend's out-of-memory error, and nothing else."""

from __future__ import annotations

import pytest
import torch

from batchfit.devices.oom import OOM_MESSAGES
from batchfit.devices.oom import is_oom

REAL_MESSAGES = [
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; 6.31 GiB already allocated)",
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 63.98 GiB total capacity)",
    "HIP error: hipErrorOutOfMemory",
    "XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; 15.11 GiB total capacity)",
    "level_zero backend failed with error: 39 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)",
    "MPS backend out of memory (MPS allocated: 17.77 GB, other allocations: 1.03 GB, max allowed: 18.13 GB).",
    "[enforce fail at alloc_cpu.cpp:83] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
    "HPU out of memory. Tried to allocate 1.00 GiB",
    "NPU out of memory. Tried to allocate 1.00 GiB",
]


@pytest.mark.parametrize("message", REAL_MESSAGES)
def test_every_backend_message_is_oom(message):
    assert is_oom(RuntimeError(message))


def test_every_table_entry_is_covered_by_a_real_message():
    for known in OOM_MESSAGES:
        assert any(known in message for message in REAL_MESSAGES), known


def test_the_oom_type_is_oom_whatever_its_message():
    assert is_oom(torch.OutOfMemoryError("anything"))


def test_a_real_cpu_allocation_failure_is_oom():
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the allocator refuses at once
    assert is_oom(info.value)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("CUDA out of memory"),  # right words, wrong type: not from an allocator
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
        RuntimeError("CUDA error: device-side assert triggered"),
        KeyboardInterrupt(),
        MemoryError(),
        TypeError("out of memory"),
    ],
)
def test_other_errors_are_not_oom(error):
    assert not is_oom(error)
