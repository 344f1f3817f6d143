"""One out-of-memory classifier for every backend.

Only real out-of-memory errors count: ``torch.OutOfMemoryError`` by type first, then the message
table below for backends and libraries that raise a plain ``RuntimeError``. Anything else is not
an OOM and must propagate unchanged.
"""

from __future__ import annotations

import torch

# Each entry names the backend whose allocator (or library) writes it.
OOM_MESSAGES: tuple[str, ...] = (
    "CUDA out of memory",  # CUDA caching allocator (older torch raised a RuntimeError)
    "CUDA error: out of memory",  # CUDA driver/runtime error, e.g. from a kernel launch or NCCL
    # cuDNN refuses a convolution it has no workspace for. Ambiguous: non-contiguous inputs and
    # unsupported configurations raise it too; Lightning and accelerate count it as OOM, as we do,
    # so such an error reads as "nothing fits" rather than propagating.
    "CUDNN_STATUS_NOT_SUPPORTED",
    "CUDNN_STATUS_ALLOC_FAILED",  # cuDNN workspace allocation
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS handle/workspace allocation
    "HIP out of memory",  # ROCm caching allocator
    "hipErrorOutOfMemory",  # ROCm runtime
    "XPU out of memory",  # Intel GPU allocator
    "UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",  # Intel unified runtime (XPU kernels)
    "MPS backend out of memory",  # Apple Metal
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "HPU out of memory",  # Habana Gaudi
    "NPU out of memory",  # Ascend (torch_npu)
)


def is_out_of_memory_type(error: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError`` (raised by CUDA, ROCm, XPU and the simulated device)."""
    return isinstance(error, torch.OutOfMemoryError)


def has_out_of_memory_message(error: BaseException) -> bool:
    """True for a ``RuntimeError`` whose message is one of the known OOM messages."""
    if not isinstance(error, RuntimeError):
        return False
    message = str(error)
    return any(known in message for known in OOM_MESSAGES)


def is_oom(error: BaseException) -> bool:
    """True only for a real out-of-memory error, from any backend.

    >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom(ValueError("out of memory"))
    False
    """
    return is_out_of_memory_type(error) or has_out_of_memory_message(error)


def summarize_oom(error: BaseException) -> str:
    """The first line of an OOM message, short enough for a table cell."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return first_line[:200]
