"""Ops whose fake kernel makes less memory than the real one, and what the trace does about them:
the CPU LSTM's workspace (``lstm_workspace_bytes``, the formula and its measurements), col2im's
output storage, the table of such ops (``UNDERCOUNTING_OPS``, each an ``Undercount``), the dispatch
mode that completes their outputs where the missing size is known and records them where it is not
(``UndercountWatch``), and the clause an estimate warns with (``undercount_message``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes


def _rnn_workspace_missing(args: tuple, out: Any) -> bool:
    # The CPU kernel returns (output, hy, cy, workspace) and keeps the workspace for backward
    # whenever grad mode is on (none under no_grad, whatever its `train` flag says); the fake
    # kernel's workspace is always empty.
    return torch.is_grad_enabled() and out[3] is not None and out[3].numel() == 0


# -- the CPU LSTM's workspace ---------------------------------------------------------------------
#
# One aten.mkldnn_rnn_layer call runs one layer in one direction (nn.LSTM calls it once per layer
# and direction, with the sequence first). Its workspace is oneDNN's training workspace: seven
# buffers, each starting on a 4 KiB page, the whole rounded up to a page. With T steps, B batch
# rows, input size I, hidden size H, S the bytes of an input element (the states and gates share
# the input's dtype), C those of the cell state and rows padded by ``_leading_dim``:
#   gates              T*B * ld(4H, S) * S
#   hidden outputs     T*B * ld(H, S) * S
#   hidden states      2*(T+1)*B * ld(max(I, H), S) * S
#   cell states        2*(T+1)*B * H * C
#   their gradients    2 * [2*(T+1)*B * ld(max(I, H), 4) * 4] + 2*(T+1)*B * H * 4   (fp32)
# Measured on torch 2.13.0+cpu (oneDNN 3.12) by calling the real op and reading its 4th output:
# exact on all 1080 shapes of T in {1,2,3,5,16,33}, B in {1,2,3,4,7,16}, I in {1,3,8,32,100,128},
# H in {1,3,8,64,100} for fp32 and for bf16 (then S = C = 2), and on every call (1152) of nn.LSTM
# forward and backward over B in {1,5}, T in {3,17}, I in {7,64}, H in {5,96}, 1-2 layers, one or
# two directions, batch_first or not, fp32, bf16 parameters, bf16 autocast and eval() with grad.
# The workspace exists iff grad mode is on, whatever requires grad. fp16 and fp64 do not run on
# this kernel here and stay under-counted; an LSTM with proj_size or a packed sequence runs
# without it (nothing to add), and a call with batch_sizes would stay under-counted too. Another
# torch build may lay its workspace out otherwise, so the formula is first checked against the
# real kernel at two small shapes (``_formula_holds``); where it disagrees, the guard stays.
PAGE_BYTES = 4096
LSTM_MODE = 2  # the `mode` argument of aten.mkldnn_rnn_layer for an LSTM
LSTM_WORKSPACE_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes the formula was measured on
_CHECK_SHAPES = ((3, 2, 5, 7), (2, 3, 300, 64))  # (T, B, I, H): small, and padded past a 256 multiple


def _leading_dim(dim: int, itemsize: int) -> int:
    """oneDNN's padded row length: a multiple of 64 bytes, one more 64 bytes when a multiple of 256."""
    step = 64 // itemsize
    padded = -(-dim // step) * step
    return padded + step if padded % 256 == 0 else padded


def lstm_workspace_bytes(
    steps: int, batch: int, input_size: int, hidden_size: int, itemsize: int = 4, cell_itemsize: int | None = None
) -> int:
    """Bytes of the workspace one CPU ``aten.mkldnn_rnn_layer`` call (one LSTM layer, one
    direction) keeps for backward under grad mode, for elements of ``itemsize`` bytes (4 for fp32,
    2 for bf16) and a cell state of ``cell_itemsize`` (the same by default). The formula and the
    measurements behind it are in the comment above.

    >>> lstm_workspace_bytes(16, 4, 32, 64), lstm_workspace_bytes(16, 4, 32, 64, itemsize=2)
    (270336, 196608)
    """
    cell_itemsize = itemsize if cell_itemsize is None else cell_itemsize
    rows, states, width = steps * batch, 2 * (steps + 1) * batch, max(input_size, hidden_size)
    parts = (
        rows * _leading_dim(4 * hidden_size, itemsize) * itemsize,  # the four gates
        rows * _leading_dim(hidden_size, itemsize) * itemsize,  # hidden outputs
        states * _leading_dim(width, itemsize) * itemsize,  # hidden states
        states * hidden_size * cell_itemsize,  # cell states
        states * _leading_dim(width, 4) * 4,  # gradients of the hidden states, by layer
        states * _leading_dim(width, 4) * 4,  # and by step
        states * hidden_size * 4,  # gradients of the cell states
    )
    offset = 0
    for nbytes in parts:
        offset = -(-offset // PAGE_BYTES) * PAGE_BYTES + nbytes
    return -(-offset // PAGE_BYTES) * PAGE_BYTES


def _real_workspace_bytes(steps: int, batch: int, input_size: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The workspace the real kernel returns at this shape (real tensors, grad mode on)."""
    gates = 4 * hidden_size
    x, h = torch.zeros(steps, batch, input_size, dtype=dtype), torch.zeros(batch, hidden_size, dtype=dtype)
    weights = (torch.zeros(gates, input_size, dtype=dtype), torch.zeros(gates, hidden_size, dtype=dtype))
    biases = (torch.zeros(gates, dtype=dtype), torch.zeros(gates, dtype=dtype))
    out = torch.ops.aten.mkldnn_rnn_layer(
        x, *weights, *biases, h, h, False, [], LSTM_MODE, hidden_size, 1, True, False, False, True
    )
    return out[3].untyped_storage().nbytes()


@functools.cache
def _formula_holds(dtype: torch.dtype) -> bool:
    """Whether this torch build's real kernel keeps what ``lstm_workspace_bytes`` says, at
    ``_CHECK_SHAPES`` (run once per dtype, on real tensors, outside the trace's modes)."""
    try:  # with the trace's modes off: nothing here is counted or faked
        with _disable_current_modes(), torch.enable_grad(), torch.autocast("cpu", enabled=False):
            return all(
                _real_workspace_bytes(*shape, dtype) == lstm_workspace_bytes(*shape, dtype.itemsize)
                for shape in _CHECK_SHAPES
            )
    except (RuntimeError, TypeError, AttributeError):  # no oneDNN LSTM for this dtype on this CPU or build
        return False


def _lstm_workspace_of(arguments: dict[str, Any]) -> int | None:
    """The bytes the real kernel's workspace has for this call, or ``None`` outside what was verified."""
    x, cx = arguments["input"], arguments["cx_"]
    verified = (
        arguments["mode"] == LSTM_MODE
        and not arguments["batch_sizes"]
        and x.dim() == 3
        and x.dtype == cx.dtype
        and x.dtype in LSTM_WORKSPACE_DTYPES
    )
    if not verified or not _formula_holds(x.dtype):
        return None
    steps, batch, input_size = x.shape
    return lstm_workspace_bytes(steps, batch, input_size, arguments["hidden_size"], x.element_size())


def _rnn_with_workspace(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``out`` with the empty fake workspace replaced by a fake one of the real size (made under the
    fake mode, so the counter counts it like any output), or ``None`` when the size is unknown."""
    names = [argument.name for argument in func._schema.arguments]
    nbytes = _lstm_workspace_of({**dict(zip(names, args, strict=False)), **kwargs})
    if nbytes is None:
        return None
    return (*out[:3], torch.empty(nbytes, dtype=torch.uint8, device=out[3].device))


# -- col2im's output storage ----------------------------------------------------------------------
#
# The CPU col2im kernel (nn.Fold's forward, nn.Unfold's backward) makes its output with
# empty_like(input) and resizes it to the output's shape, so the output's storage keeps
# max(input, output) elements; the fake kernel allocates the output's alone (nn.Unfold's step
# traced at 0.78 of the real peak). Measured on torch 2.13.0+cpu: exact on 864 calls, batched or
# not, fp32, bf16 and fp64, kernel 1-3, stride 1-3, two output sizes, contiguous input or not.
# Checked against the real kernel once per process (``_col2im_formula_holds``).
COL2IM = "aten::col2im"


def _col2im_shape(columns: torch.Tensor, output_size: Any, kernel_size: Any) -> tuple[int, ...]:
    channels = columns.shape[-2] // (kernel_size[0] * kernel_size[1])
    return (*columns.shape[:-2], channels, *output_size)


@functools.cache
def _col2im_formula_holds() -> bool:
    """Whether the real kernel keeps ``max(input, output)`` elements at two small shapes, one
    with the input larger and one with the output larger."""
    calls = (((2, 16, 32), (5, 9), (2, 2), (1, 1)), ((1, 1, 9), (8, 8), (1, 1), (3, 3)))
    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False):
            for shape, size, kernel, stride in calls:
                out = torch.ops.aten.col2im(torch.zeros(shape), size, kernel, (1, 1), (0, 0), stride)
                if out.untyped_storage().nbytes() != max(math.prod(shape), out.numel()) * 4:
                    return False
    except (RuntimeError, TypeError):
        return False
    return True


def _col2im_missing(args: tuple, out: Any) -> bool:
    columns = args[0]
    return out.untyped_storage().nbytes() < columns.numel() * columns.element_size()


def _col2im_as_real(func: Any, args: tuple, kwargs: dict) -> Any:
    """col2im's output in a storage of the real kernel's size (made under the counting and fake
    modes, so counted once), or ``None`` where this build's kernel was not checked."""
    names = [argument.name for argument in func._schema.arguments]
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    columns = given["self"]
    if columns.dim() not in (2, 3) or not _col2im_formula_holds():
        return None
    shape = _col2im_shape(columns, given["output_size"], given["kernel_size"])
    storage = torch.empty(max(columns.numel(), math.prod(shape)), dtype=columns.dtype, device=columns.device)
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return storage.as_strided(shape, strides)


class Undercount(NamedTuple):
    """An op whose fake kernel makes less than the real one: ``missing(args, out)`` says whether
    this output is short, ``what`` names what is missing, ``complete(func, args, kwargs, out)``
    returns the output made whole (counted like any other) or ``None`` when the missing size is
    unknown, and ``instead(func, args, kwargs)``, where given, makes the real kernel's output in
    place of the fake kernel's (no second output alive for a moment), or ``None``."""

    missing: Callable[[tuple, Any], bool]
    what: str
    complete: Callable[[Any, tuple, dict, Any], Any]
    instead: Callable[[Any, tuple, dict], Any] | None = None


# Ops whose fake kernel makes less memory than the real one, measured by comparing the storage
# bytes of every output, real against fake, for the forward and backward of nn.LSTM (with
# layers, bidirectional, under bf16 autocast), nn.GRU, nn.RNN, nn.LSTMCell, nn.MultiheadAttention,
# scaled_dot_product_attention (with dropout), nn.TransformerEncoderLayer, convolutions, batch,
# layer and group norm, pooling, upsampling, dropout and embeddings on CPU, and by comparing the
# traced peak with the real one for every layer type in torch.nn (benchmarks/nn_layers_trace.py):
# only these ops differ (an LSTM with proj_size runs without the workspace). The trace completes
# them where the size is known.
UNDERCOUNTING_OPS: dict[str, Undercount] = {
    "aten::mkldnn_rnn_layer": Undercount(
        _rnn_workspace_missing, "the LSTM workspace kept for backward", _rnn_with_workspace
    ),
    COL2IM: Undercount(
        _col2im_missing,
        "the output's storage, kept at the input's size",
        lambda func, args, kwargs, out: None,
        _col2im_as_real,
    ),
}


class UndercountWatch(TorchDispatchMode):
    """Completes the outputs of ``UNDERCOUNTING_OPS`` whose missing bytes it knows, and records the
    ops whose fake output stays smaller than the real one. Entered above the counting mode, so
    what it makes is counted. ``complete=False`` (a trace for another device than the CPU, whose
    kernels keep other workspaces) only records."""

    def __init__(self, seen: dict[str, None], complete: bool = True):
        super().__init__()
        self.seen, self.complete = seen, complete

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = UNDERCOUNTING_OPS.get(func.name())
        if entry is not None and entry.instead is not None and self.complete:
            made = entry.instead(func, args, kwargs)
            if made is not None:
                return made
        out = func(*args, **kwargs)
        if entry is None or not entry.missing(args, out):
            return out
        completed = entry.complete(func, args, kwargs, out) if self.complete else None
        if completed is None:
            self.seen[func.name()] = None
            return out
        return completed


def undercount_message(ops: tuple[str, ...] | list[str]) -> str:
    """Which ops the trace under-counts and what their fake kernels leave out, in one clause.

    >>> undercount_message(["aten::mkldnn_rnn_layer"])
    'the trace under-counts aten::mkldnn_rnn_layer (the LSTM workspace kept for backward), so the real peak is higher'
    """
    parts = ", ".join(f"{op} ({UNDERCOUNTING_OPS[op].what if op in UNDERCOUNTING_OPS else 'its output'})" for op in ops)
    return f"the trace under-counts {parts}, so the real peak is higher"
