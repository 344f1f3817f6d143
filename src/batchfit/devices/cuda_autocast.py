"""Autocast as CUDA casts, on the trace's fake CPU tensors.

Autocast keeps one op list for CUDA (shared with XPU and others: ``AT_FORALL_*`` in ``ATen/autocast_mode.h``,
torch 2.13) and its own for the CPU (``autocast_mode.cpp``, ``AutocastCPU``). Under bf16 or fp16 autocast CUDA
runs ``layer_norm``, ``softmax``, ``log_softmax``, ``pow``, ``exp``, ``sum`` and the norms in fp32, where the CPU
keeps them in 16 bits: a GPT-2's ``gelu_new`` (``pow``) makes its whole MLP chain fp32 on a GPU. A trace for a
GPU must cast as the GPU does. While ``cuda_autocast(mode)`` is active, every op CUDA's lists name and the CPU's
do not gets CUDA's policy at ``AutocastCPU`` for fake tensors of ``mode``; real tensors and other fake modes go on
as the CPU's autocast sends them (the op had no CPU autocast kernel: it falls through). Ops both lists name keep
the CPU's kernel (the same policy); ops only the CPU casts (``cross_entropy_loss``, pads, 3-D pools) keep it too,
an over-count where CUDA would not cast. Not emulated: the cast cache of a weight used by several of these ops
(``linear`` and the convolutions, which CUDA caches, keep the CPU's kernel and its cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# torch 2.13's ATen/autocast_mode.h, the lists CUDA registers (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE); overload names as the dispatcher spells them.
LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)  # fmt: skip
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)  # fmt: skip
POLICIES = {"lower": LOWER_PRECISION, "fp32": FP32, "set_opt_dtype": FP32_SET_OPT_DTYPE, "promote": PROMOTE}
AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def cuda_only_ops() -> dict[str, str]:
    """The ops CUDA's lists name and the CPU's autocast leaves alone, with CUDA's policy for each."""
    return {
        name: policy
        for policy, names in POLICIES.items()
        for name in names
        if hasattr(getattr(torch.ops.aten, name.partition(".")[0], None), name.partition(".")[2] or "default")
        and not torch._C._dispatch_has_kernel_for_dispatch_key(_overload(name).name(), AUTOCAST_CPU)
    }


def _eligible(value: Any) -> bool:
    """``is_eligible``: a floating tensor of the autocast device, not fp64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    return value.to(dtype) if _eligible(value) and value.dtype != dtype else value


def _tensors(values: Any) -> Iterator[Any]:
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, torch.Tensor):
            yield value


def _policy(op: Any, policy: str, mode: Any) -> Any:
    """A kernel at ``AutocastCPU``: CUDA's ``policy`` for fake tensors of ``mode``, else on to the next key."""
    excluded = torch._C.DispatchKeySet(AUTOCAST_CPU)
    dtype_index = next((i for i, arg in enumerate(op._schema.arguments) if arg.name == "dtype"), None)

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        if not any(getattr(t, "fake_mode", None) is mode for t in _tensors([*args, *kwargs.values()])):
            return op.redispatch(keyset.remove(AUTOCAST_CPU), *args, **kwargs)
        lower = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            if policy == "lower":
                return op(*_cast(args, lower), **kwargs)
            if policy == "fp32":
                return op(*_cast(args, torch.float32), **kwargs)
            if policy == "promote":
                wide = any(t.dtype == torch.float32 for t in _tensors(args) if _eligible(t))
                return op(*_cast(args, torch.float32 if wide else lower), **kwargs)
            return op(*_float_dtype(args, dtype_index), **_float_dtype_kwargs(args, kwargs, dtype_index))

    return kernel


def _float_dtype(args: tuple, dtype_index: int | None) -> tuple:
    """``fp32_set_opt_dtype``, a positional dtype: ``None`` becomes ``float32`` where the first argument is eligible."""
    if (
        args
        and _eligible(args[0])
        and dtype_index is not None
        and dtype_index < len(args)
        and args[dtype_index] is None
    ):
        return (*args[:dtype_index], torch.float32, *args[dtype_index + 1 :])
    return args


def _float_dtype_kwargs(args: tuple, kwargs: dict[str, Any], dtype_index: int | None) -> dict[str, Any]:
    """``fp32_set_opt_dtype``, no positional dtype: ``dtype=float32`` where none is given."""
    positional = dtype_index is not None and dtype_index < len(args)
    if args and _eligible(args[0]) and not positional and kwargs.get("dtype") is None:
        return {**kwargs, "dtype": torch.float32}
    return kwargs


@contextlib.contextmanager
def cuda_autocast(mode: Any) -> Iterator[None]:
    """While active, CPU autocast casts ``mode``'s fake tensors as CUDA's autocast would (see the module)."""
    library = torch.library.Library("aten", "IMPL")
    try:
        for name, policy in cuda_only_ops().items():
            library.impl(name, _policy(_overload(name), policy, mode), "AutocastCPU", with_keyset=True)
        yield
    finally:
        library._destroy()
