"""The kernels CUDA runs where the CPU runs others, on the trace's fake CPU tensors: attention and dropout.

``F.scaled_dot_product_attention`` picks a kernel by device. On the CPU, with dropout, it takes the math path
and keeps three fp32 batch x heads x seq x seq tensors for backward (HF GPT-2 trains with ``dropout_p=0.1``); on a
GPU, the flash or memory-efficient kernel keeps the output, a log-sum-exp and an RNG state. A trace for a GPU must
run what the GPU runs: while ``cuda_attention(mode, target)`` is active, SDPA on the trace's fake tensors runs the
aten op CUDA would choose (``_scaled_dot_product_{flash,efficient,cudnn}_attention``, or the math one). Their meta
kernels and autograd formulas are device-agnostic, so autograd saves on fake CPU tensors what it saves on the GPU.

The choice follows torch's ``select_sdp_backend`` (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, torch
2.13) and the composite around it (``attention.cpp``): each check below names the C++ function it follows. The
override is a ``torch.library`` kernel at ``AutogradCPU`` (a function mode would miss the recompute of
non-reentrant activation checkpointing); it leaves real tensors and other fake modes to the original composite.

Dropout: ``aten::dropout`` takes the fused ``native_dropout`` on CUDA (``is_fused_kernel_acceptable`` in
``aten/src/ATen/native/Dropout.cpp``), which keeps a one-byte boolean mask for backward; the CPU keeps noise in
the input's dtype (two or four bytes an element). ``cuda_dropout`` runs the fused one on fake tensors.

Beside their outputs, the attention backward kernels take fp32 scratch while they run (flash: ``dq_accum`` and
``softmax_d``; memory-efficient: ``delta`` and a dQ accumulator), and cuBLAS keeps a workspace per handle:
``CudaScratch`` counts both; cuDNN's convolution workspaces only the card can size, and it says so. cuDNN attention is
preferred on sm90/sm100 only with a runtime cuDNN above 9.15.0 (``check_prefer_cudnn_attention``), which depends
on the installation: ``CudaTarget.cudnn_version`` (default 0: not preferred) says which.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a trace runs for: its compute capability (``sm``), the runtime cuDNN version (0: not known, so
    cuDNN attention is not preferred), and which SDPA backends are enabled (torch's defaults: all)."""

    sm: tuple[int, int] = (9, 0)
    cudnn_version: int = 0
    efficient_gqa: bool = False  # the memory-efficient kernel's native grouped-query attention (later than 2.13)
    flash: bool = True
    efficient: bool = True
    cudnn: bool = True
    math: bool = True

    def priority(self) -> tuple[str, ...]:
        """``priority_order``: the default (Context.h ``sdp_priority_order``), cuDNN first where
        ``check_prefer_cudnn_attention`` holds (cuDNN > 9.15.0 on sm90/sm100)."""
        major, minor = self.sm
        if self.cudnn_version > 91500 and major in (9, 10) and minor in (0, 3):
            return ("cudnn", "flash", "efficient", "math")
        return ("flash", "efficient", "math", "cudnn")


def _within(sm: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= sm <= high


def _heads_ok(q: Any, k: Any, v: Any, enable_gqa: bool, supports_gqa: bool) -> bool:
    """``check_batch_size_and_num_heads_dense`` with ``check_grouped_query_attention``."""
    if not q.size(0) == k.size(0) == v.size(0):
        return False
    heads_q, heads_k, heads_v = q.size(1), k.size(1), v.size(1)
    if heads_q == heads_k == heads_v:
        return True
    return enable_gqa and supports_gqa and heads_k == heads_v and heads_q % heads_k == 0


def _dense(q: Any, k: Any, v: Any, mask: Any, ignore_singleton_dim: bool) -> bool:
    """``check_tensor_shapes``, ``check_nonzero_sequence_lengths_dense``, ``check_last_dim_stride_equals_1_dense``."""
    if not q.dim() == k.dim() == v.dim() == 4 or q.is_nested or k.is_nested or v.is_nested:
        return False
    if q.size(2) == 0 or k.size(2) == 0:
        return False
    unit = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton_dim and q.size(-1) == 1)
    return unit and (mask is None or mask.stride(-1) == 1)


def can_flash(
    target: CudaTarget, q: Any, k: Any, v: Any, mask: Any, p: float, causal: bool, gqa: bool, grad: bool
) -> bool:
    """``can_use_flash_attention``: half precision, no mask, head dim at most 256, sm80 to sm121."""
    if not target.flash or mask is not None or not _dense(q, k, v, mask, True):
        return False
    dim = q.size(-1)
    if not (dim == k.size(-1) == v.size(-1) and dim <= 256) or not _within(target.sm, (8, 0), (12, 1)):
        return False  # check_head_dim_size_flash, check_flash_attention_hardware_support
    small_smem = _within(target.sm, (8, 6), (8, 9)) or _within(target.sm, (12, 0), (12, 1))
    if grad and small_smem and not (dim <= 192 or (p == 0 and dim > 224)):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if causal and q.size(2) != k.size(2):
        return False  # check_flash_causal_non_square_seqlens
    return q.dtype == k.dtype == v.dtype and q.dtype in HALF and _heads_ok(q, k, v, gqa, True)


def can_efficient(
    target: CudaTarget, q: Any, k: Any, v: Any, mask: Any, p: float, causal: bool, gqa: bool, grad: bool
) -> bool:
    """``can_use_mem_efficient_attention``: fp32 too (sm80+), any mask, head dims aligned to the GEMM."""
    if not target.efficient or not _within(target.sm, (5, 0), (12, 1)) or not _dense(q, k, v, mask, False):
        return False
    half = q.dtype in HALF
    align = (
        (8 if half else 4) if target.sm[0] >= 8 else (8 if half and target.sm[0] >= 7 else 1)
    )  # minimum_gemm_alignment
    dim_q, dim_k, dim_v = q.size(-1), k.size(-1), v.size(-1)
    if not (dim_q == dim_k and dim_q % align == 0 and dim_v % align == 0):
        return False  # check_head_dim_size_mem_efficient
    if target.sm[0] >= 8 and any(t.storage_offset() % align for t in (q, k, v)):
        return False  # check_data_ptr_alignment_mem_efficient
    dtypes = (torch.float16, torch.bfloat16, torch.float32) if target.sm[0] >= 8 else (torch.float16, torch.float32)
    return q.dtype == k.dtype == v.dtype and q.dtype in dtypes and _heads_ok(q, k, v, gqa, target.efficient_gqa)


def can_cudnn(
    target: CudaTarget, q: Any, k: Any, v: Any, mask: Any, p: float, causal: bool, gqa: bool, grad: bool
) -> bool:
    """``can_use_cudnn_attention``: half precision, dropout in sixteenths, head dim a multiple of 8 up to 128."""
    if not target.cudnn or target.cudnn_version < 90000 or torch.are_deterministic_algorithms_enabled():
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in HALF) or not _within(target.sm, (8, 0), (12, 1)):
        return False
    if p * 16 != math.floor(p * 16) or not _dense(q, k, v, mask, True) or not _heads_ok(q, k, v, True, True):
        return False  # check_cudnn_dropout
    if mask is not None and not _cudnn_mask_ok(q, k, mask):
        return False
    batch, heads, seq_q, dim_qk = q.shape
    dim_v = v.size(-1)
    if batch > 65535 or heads > 65535 or dim_qk > 128 or dim_v > 128 or dim_qk % 8 or dim_v % 8:
        return False  # check_cudnn_tensor_shapes (the 256 limit needs a newer cuDNN than torch 2.13 assumes)
    return k.size(2) != 1 and not (p and seq_q == 1)


def _cudnn_mask_ok(q: Any, k: Any, mask: Any) -> bool:
    """``check_attn_mask_shape``: 2-D, or 4-D broadcasting over batch and heads, not requiring grad."""
    if mask.requires_grad or mask.size(-2) not in (q.size(2), 1) or mask.size(-1) not in (k.size(2), 1):
        return False
    return mask.dim() == 2 or (mask.dim() == 4 and mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1)))


CHECKS = {"flash": can_flash, "efficient": can_efficient, "cudnn": can_cudnn}


def choose_backend(
    target: CudaTarget,
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    p: float = 0.0,
    causal: bool = False,
    gqa: bool = False,
) -> str:
    """``select_sdp_backend``: the first backend in priority order whose checks pass; math as the fallback.

    >>> q = torch.zeros(2, 12, 1024, 64, dtype=torch.bfloat16)
    >>> choose_backend(CudaTarget(), q, q, q, p=0.1, causal=True), choose_backend(CudaTarget(), q.float(), q.float(), q.float())
    ('flash', 'efficient')
    """
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    for name in target.priority():
        if name == "math":
            if target.math:
                return name
        elif CHECKS[name](target, q, k, v, mask, p, causal, gqa, grad):
            return name
    raise RuntimeError("no scaled-dot-product attention backend is enabled for this target")


def _additive(mask: Any, dtype: torch.dtype) -> Any:
    """``convert_boolean_attn_mask``: a boolean mask becomes an additive one in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _efficient_bias(mask: Any, q: Any, k: Any) -> Any:
    """``preprocess_mask`` and ``pad_bias<16>``: expanded to (B, H, L, S), its last dim padded to 16 (a copy)."""
    bias = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    last = bias.size(-1)
    if last % 16:
        return F.pad(bias, (0, 16 - last % 16))[..., :last]
    if bias.stride(0) % 16 or bias.stride(1) % 16 or bias.stride(2) % 16:
        return bias.contiguous()
    return bias


def cuda_sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    target: CudaTarget,
) -> Any:
    """``at::native::scaled_dot_product_attention`` on CUDA: the chosen backend's aten op, prepared as the
    composite prepares it (head dims padded to 8 for flash, masks made additive and padded for efficient)."""
    backend = choose_backend(target, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    needs_lse = torch.is_grad_enabled() and any(
        t.requires_grad for t in (query, key, value)
    )  # should_compute_logsumexp
    if backend == "flash":
        dim = query.size(-1)
        if dim % 8:  # pad_last_dim<8>: a padded copy of each
            query, key, value = (F.pad(t, (0, 8 - dim % 8)) for t in (query, key, value))
        scale = scale if scale is not None else 1.0 / math.sqrt(dim)
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        return out[..., :dim]
    mask = _additive(attn_mask, query.dtype)
    if backend == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, mask, needs_lse, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == "efficient":
        if key.size(1) != query.size(1):  # native GQA reduces dK/dV itself: repeated heads are an upper bound
            groups = query.size(1) // key.size(1)
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        bias = _efficient_bias(mask, query, key) if mask is not None else None
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_lse, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]


@contextlib.contextmanager
def cuda_attention(mode: Any, target: CudaTarget, chosen: list[str] | None = None) -> Iterator[None]:
    """While active, SDPA on fake tensors of ``mode`` (the trace's fake mode) runs the kernel ``target`` would;
    every other call (real tensors, another fake mode, another thread's) runs torch's own composite. ``chosen``
    collects the backends picked."""
    library = torch.library.Library("aten", "IMPL")
    original = aten.scaled_dot_product_attention.default

    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        if getattr(query, "fake_mode", None) is not mode:  # torch's own C++ composite, as without the override
            return original._op_dk(
                COMPOSITE, query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        if chosen is not None:
            chosen.append(choose_backend(target, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa))
        return cuda_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, target=target)

    library.impl("scaled_dot_product_attention", kernel, "AutogradCPU")
    try:
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def cuda_dropout(mode: Any) -> Iterator[None]:
    """While active, dropout on fake tensors of ``mode`` in training runs CUDA's fused ``native_dropout`` (a
    boolean mask kept for backward); everything else runs torch's own composite."""
    library = torch.library.Library("aten", "IMPL")
    original = aten.dropout.default

    def kernel(input, p, train):
        fused = train and 0 < p < 1 and input.numel() > 0 and not input.is_nested
        if getattr(input, "fake_mode", None) is not mode or not fused:
            return original._op_dk(COMPOSITE, input, p, train)  # the C++ composite (its Python one always fuses)
        return aten.native_dropout(input, p, train)[0]

    library.impl("dropout", kernel, "AutogradCPU")
    try:
        yield
    finally:
        library._destroy()


# -- what CUDA's kernels take beside their outputs ------------------------------------------------------------


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def _flash_backward_scratch(args: tuple) -> list[Any]:
    """``mha_bwd`` (flash_attn/flash_api.cpp): ``softmax_d`` (B, H, Sq rounded to 128) and ``dq_accum``
    (B, Sq rounded to 128, H, D rounded to 32, or 64 past 128), both fp32, for the whole backward call."""
    query = args[1]
    batch, heads, seq, dim = query.shape
    rows = _round_up(seq, 128)
    width = _round_up(dim, 32 if dim <= 128 else 64)
    return [
        query.new_empty((batch, heads, rows), dtype=torch.float32),
        query.new_empty((batch, rows, heads, width), dtype=torch.float32),
    ]


def _efficient_backward_scratch(args: tuple) -> list[Any]:
    """``_efficient_attention_backward`` (cuda/attention_backward.cu): ``delta`` (B, H, Sq) fp32 and, for 16-bit
    inputs, an fp32 accumulator of the query's gradient (B, H, Sq, D)."""
    query = args[1]
    batch, heads, seq, dim = query.shape
    scratch = [query.new_empty((batch, heads, seq), dtype=torch.float32)]
    if query.dtype in HALF:
        scratch.append(query.new_empty((batch, heads, seq, dim), dtype=torch.float32))
    return scratch


BACKWARD_SCRATCH = {
    "aten::_scaled_dot_product_flash_attention_backward": _flash_backward_scratch,
    "aten::_scaled_dot_product_efficient_attention_backward": _efficient_backward_scratch,
}
CONVOLUTIONS = ("aten::convolution", "aten::convolution_backward", "aten::_convolution")
CONVOLUTION_NOTE = (
    "cuDNN's convolution workspaces, which the caching allocator gives each convolution while it runs: their size "
    "depends on the algorithm cuDNN picks on the card (CUDNN_CONV_WSCAP_DBG caps it)"
)


def cublas_workspace_bytes(sm: tuple[int, int]) -> int:
    """``parseChosenWorkspaceSize`` (aten/src/ATen/cuda/CublasHandlePool.cpp): 32 MiB on Hopper and later, else
    ``:4096:2:16:8`` (2 x 4 MiB + 8 x 16 KiB), one per cuBLAS handle and stream, from the caching allocator."""
    return 32 * 2**20 if sm[0] >= 9 else 2 * 4 * 2**20 + 8 * 16 * 2**10


CUBLAS_HANDLES = 2  # the forward's thread and autograd's device thread each hold one (a handle per thread)


class CudaScratch(TorchDispatchMode):
    """Entered above the counting mode: counts, for the length of each call, the scratch a CUDA attention
    backward kernel takes, and notes in ``not_counted`` what only the card can size (convolution workspaces)."""

    def __init__(self, not_counted: dict[str, None]):
        super().__init__()
        self.not_counted = not_counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        scratch = BACKWARD_SCRATCH.get(name)
        if scratch is not None:
            taken = scratch(args)
            out = func(*args, **(kwargs or {}))
            del taken
            return out
        if name in CONVOLUTIONS:
            self.not_counted[CONVOLUTION_NOTE] = None
        return func(*args, **(kwargs or {}))
