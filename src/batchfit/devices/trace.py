"""TraceDevice: the simulated device's accounting with nothing computed and nothing allocated.

The workload is copied with every tensor replaced by a fake one (``FakeTensorMode``, CPU
kernels: shapes, dtypes and storages, no data), so a trial at batch 4096 costs about what one
at batch 1 costs. The meta device is not used: it decomposes scaled-dot-product attention and
over-counts transformers. The user's model and optimizer are never touched.

Two guards keep the trace honest. An op whose fake kernel makes less than the real one (the CPU
LSTM's workspace, col2im's storage, see ``UNDERCOUNTING_OPS``) gets what it lacks where its size
is known (the LSTM's, from ``lstm_workspace_bytes``), counted like any output; where it is not (an
unmeasured dtype, a torch build whose kernel disagrees), the op is recorded in
``TraceDevice.undercounted_ops``, so an estimate can say it is a lower bound. And an error on fake tensors is sorted by
``is_users_error``: the user's own ``ValueError``/``TypeError`` (it would raise on the real
device too) against what fake tensors cannot do (a ``TraceError``: fall back to real probing).

Stock layers that ask their data a question (``nn.TransformerEncoder`` checking whether a mask is
causal, ``nn.GaussianNLLLoss`` its variances, ``nn.AdaptiveLogSoftmaxWithLoss`` picking rows by
target, ``nn.CTCLoss`` and ``pack_padded_sequence`` reading lengths) get the answer the real step
gets: the trace keeps real copies of the values it can know (from the sample and buffers, never the
parameters; see ``_TraceFakeMode``). The nested-tensor fast path of ``nn.TransformerEncoder`` runs
on a dense stand-in of the nested buffer's size (``_NestedStandIns``). What is left, a question
about values made from the parameters, is a one-line ``TraceError``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import weakref
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.base import CountingDevice
from batchfit.devices.presets import ACCELERATORS
from batchfit.devices.presets import is_preset
from batchfit.devices.presets import usable_bytes
from batchfit.devices.simulated import CUDA_BLOCK_BYTES
from batchfit.devices.simulated import SimulatedDevice
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.errors import TraceError
from batchfit.step.batching import map_tensors
from batchfit.step.workload import Workload

CUDA_LARGE_ROUND_BYTES = 2 * 2**20  # the caching allocator rounds requests over 1 MiB to 2 MiB segments
UNLIMITED_BYTES = 1 << 60  # a capacity no trace reaches: an estimate measures the whole peak
TRACE_DEVICE_HELP = (
    "give a TraceDevice or SimulatedDevice, 'trace:CAPACITY' or 'sim:CAPACITY' (e.g. 'sim:40GiB'), "
    "a GPU preset such as 'a100-40gb', a capacity such as '40GiB' or a byte count, or None"
)


# What fake tensors raise for what they cannot do (all RuntimeErrors in torch 2.x).
FAKE_TENSOR_ERRORS = (
    fake_tensor.DataDependentOutputException,  # .item(), .tolist(), bool(t), torch.equal, ...
    fake_tensor.DynamicOutputShapeException,  # torch.nonzero, masked indexing, torch.unique, ...
    fake_tensor.UnsupportedOperatorException,  # an op without a fake kernel
    fake_tensor.UnsupportedFakeTensorException,
    GuardOnDataDependentSymNode,
)
# Source files only fake tensors run through: an error raised in them is the trace's.
FAKE_TENSOR_SOURCES = (
    "torch/_subclasses/",
    "torch/_meta_registrations.py",
    "torch/_refs/",
    "torch/_prims/",
    "torch/_prims_common/",
    "torch/_decomp/",
    "torch/fx/experimental/",
)
# batchfit's own trace-only modules: an error raised there is batchfit's, never the user's.
TRACE_SOURCES = ("batchfit/devices/trace.py", "batchfit/devices/accounting.py", "batchfit/search/estimate.py")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _raised_by_fakes(error: BaseException) -> bool:
    """Whether ``error`` comes from fake tensors or from batchfit's trace, not from the user's code."""
    if isinstance(error, (TraceError, *FAKE_TENSOR_ERRORS)):
        return True
    message = str(error).lower()
    if "faketensor" in message or "fake tensor" in message:  # e.g. f"{loss:.3f}" on a fake scalar
        return True
    frames = list(_source_files(error.__traceback__))
    if any(part in name for name in frames for part in FAKE_TENSOR_SOURCES):
        return True
    return bool(frames) and frames[-1].endswith(TRACE_SOURCES)


def _source_files(traceback: Any) -> Iterator[str]:
    """The file of every frame of ``traceback``, outermost first, with ``/`` separators."""
    while traceback is not None:
        yield traceback.tb_frame.f_code.co_filename.replace("\\", "/")
        traceback = traceback.tb_next


def is_users_error(error: BaseException) -> bool:
    """Whether ``error``, raised while a step ran on fake tensors, is the user's own mistake: a
    ``ValueError``/``TypeError`` their model, loss or step raised, which the real device would
    raise too. Not the user's: a ``TraceError``, what fake tensors raise (data-dependent
    values or shapes, ops without a fake kernel, see ``FAKE_TENSOR_ERRORS``) or an error raised
    inside torch's fake-tensor code or batchfit's trace, also when the user's code re-raised it.

    >>> is_users_error(ValueError("bad targets")), is_users_error(TraceError("no fake kernel"))
    (True, False)
    """
    if not isinstance(error, (ValueError, TypeError)) or isinstance(error, NoBatchFitsError):
        return False
    return not any(_raised_by_fakes(link) for link in _chain(error))


def trace_error(error: BaseException) -> TraceError:
    """A one-line ``TraceError`` saying which error stopped the trace and what to do instead."""
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    return TraceError(
        f"cannot trace this workload on fake tensors ({type(error).__name__}: {reason}); "
        "measure it with `batchfit find` on a real or simulated device instead"
    )


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Turn what fake tensors cannot do into a ``TraceError`` that says why; the user's own
    ``ValueError``/``TypeError`` (see ``is_users_error``), a ``TraceError``, ``NoBatchFitsError``
    and ``KeyboardInterrupt`` pass unchanged."""
    try:
        yield
    except Exception as error:
        if isinstance(error, (TraceError, NoBatchFitsError)) or is_users_error(error):
            raise
        raise trace_error(error) from error


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


# -- what real execution decides: data the trace keeps beside its fake tensors ---------------------
#
# Fake tensors have no values, so a step that asks its data a question stops the trace: a causal
# mask checked for being causal (nn.TransformerEncoder and its layers), a padding mask checked for
# left alignment, `torch.any(var < 0)` (nn.GaussianNLLLoss), rows picked by `nonzero` on the
# targets (nn.AdaptiveLogSoftmaxWithLoss). The values asked about come from the batch, the
# buffers or constants made in forward, never from the parameters, and they are small: the trace
# keeps a real copy beside every fake tensor whose value it can know (the sample's rows, small
# buffers, and whatever an op makes from only such tensors, up to ``SHADOW_MAX_BYTES``), so such a
# question gets the answer the real step gets for the same batch, and an op whose output shape
# depends on values (nonzero, masked indexing) gets a fake output of the real shape. Nothing is
# computed for what depends on the parameters. The real copies are host memory, never counted.
SHADOW_MAX_BYTES = 64 * 2**20  # the largest tensor the trace keeps real values of
SHADOW_BUDGET_BYTES = 256 * 2**20  # the most host memory the kept values take at once
_CPU = torch.device("cpu")
# Ops whose values are garbage until written: nothing to keep (and nothing to allocate for real).
_UNINITIALIZED = frozenset(("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Shadows:
    """The real values beside fake tensors: kept while the fake lives, dropped when a write the
    trace cannot repeat on the real copy (with data it does not know) reaches the fake's storage."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}  # id(fake) -> (fake, real, storage)
        self._storages: dict[int, int] = {}  # storage key of a fake with a shadow -> how many
        self.kept_bytes = 0  # of the real copies (a view's counted like its own tensor: an upper bound)

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        same = fake.shape == real.shape and fake.dtype == real.dtype and fake.layout == real.layout == torch.strided
        nbytes = _nbytes(real)
        if not same or isinstance(real, fake_tensor.FakeTensor) or nbytes > SHADOW_MAX_BYTES:
            return
        key, storage = id(fake), fake.untyped_storage()._cdata
        self.drop(key)
        if self.kept_bytes + nbytes > SHADOW_BUDGET_BYTES:
            return
        self._values[key] = (weakref.ref(fake, lambda _ref, k=key: self.drop(k)), real, storage)
        self._storages[storage] = self._storages.get(storage, 0) + 1
        self.kept_bytes += nbytes

    def drop(self, key: int) -> None:
        entry = self._values.pop(key, None)
        if entry is not None:
            self.kept_bytes -= _nbytes(entry[1])
            count = self._storages.pop(entry[2]) - 1
            if count:
                self._storages[entry[2]] = count

    def get(self, fake: torch.Tensor) -> torch.Tensor | None:
        entry = self._values.get(id(fake))
        return entry[1] if entry is not None and entry[0]() is fake else None

    def written(self, fake: torch.Tensor) -> None:
        """``fake``'s storage was written with values the trace does not know: forget them."""
        storage = fake.untyped_storage()._cdata
        if storage in self._storages:
            for key in [k for k, entry in self._values.items() if entry[2] == storage]:
                self.drop(key)


_UNKNOWN = object()  # a value the trace cannot know


def _leaves(value: Any) -> Iterator[Any]:
    """The items of ``value`` and of the lists, tuples and dicts in it (an op's arguments)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _all_known(values: Iterable[Any], shadows: _Shadows) -> bool:
    """Whether every fake tensor in ``values`` (and in the lists and tuples in them) has real values kept:
    the quick test before anything is computed, failing at the first parameter-derived one."""
    known = shadows._values
    for value in values:
        if isinstance(value, fake_tensor.FakeTensor):
            if id(value) not in known:
                return False
        elif isinstance(value, (list, tuple)) and not _all_known(value, shadows):
            return False
    return True


def _to_real(value: Any, shadows: _Shadows) -> Any:
    """``value`` with every fake tensor replaced by its real copy (``_UNKNOWN`` if one has none) and
    every device by the CPU, where the real copies live."""
    if isinstance(value, (list, tuple)):
        items = [_to_real(item, shadows) for item in value]
        return _UNKNOWN if any(item is _UNKNOWN for item in items) else type(value)(items)
    if isinstance(value, dict):
        real = {key: _to_real(item, shadows) for key, item in value.items()}
        return _UNKNOWN if any(item is _UNKNOWN for item in real.values()) else real
    if isinstance(value, fake_tensor.FakeTensor):
        real = shadows.get(value)
        return _UNKNOWN if real is None else real
    return _CPU if isinstance(value, torch.device) else value


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The positions and names of the arguments ``func`` writes into (in-place and ``out=`` ops)."""
    arguments = func._schema.arguments
    return tuple((i, arg.name) for i, arg in enumerate(arguments) if arg.alias_info and arg.alias_info.is_write)


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    for index, name in _written_arguments(func):
        yield from _leaves(args[index] if index < len(args) else kwargs.get(name))


def _real_call(func: Any, args: tuple, kwargs: dict, shadows: _Shadows) -> Any:
    """What ``func`` returns on the real copies, or ``_UNKNOWN`` when an argument has none, the op
    draws random numbers (its values would differ, and the generator would move) or fails."""
    if func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags:
        return _UNKNOWN  # (other namespaces: the profiler's records, prims the fake kernels answer)
    if func._schema.name in _UNINITIALIZED:
        return _UNKNOWN
    if any(type(t) is torch.Tensor for t in _written_tensors(func, args, kwargs)):
        return _UNKNOWN  # a real tensor of the user's, written in place: never on the real copies
    real_args, real_kwargs = _to_real(args, shadows), _to_real(kwargs, shadows) if kwargs else {}
    if real_args is _UNKNOWN or real_kwargs is _UNKNOWN:
        return _UNKNOWN
    if "pin_memory" in real_kwargs:
        real_kwargs["pin_memory"] = False
    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            return _unshared(func(*real_args, **real_kwargs), (args, kwargs))
    except Exception:  # a value the trace cannot know, as if never asked
        return _UNKNOWN


def _unshared(real: Any, arguments: Any) -> Any:
    """``real`` with each tensor that shares storage with a real (not fake) argument copied: the
    counter counts such an argument (a constant lifted into the trace) until it dies, and a kept
    copy must not keep it alive."""
    given = {t.untyped_storage()._cdata for t in _leaves(arguments) if type(t) is torch.Tensor}
    if not given:
        return real
    if isinstance(real, (list, tuple)):
        return type(real)(_unshared(item, arguments) for item in real)
    if isinstance(real, torch.Tensor) and real.untyped_storage()._cdata in given:
        return real.clone()
    return real


def _small(out: Any) -> bool:
    return all(_nbytes(t) <= SHADOW_MAX_BYTES for t in _leaves(out) if isinstance(t, torch.Tensor))


def _attach(shadows: _Shadows, out: Any, real: Any) -> None:
    fakes, reals = list(_leaves(out)), list(_leaves(real))
    if len(fakes) == len(reals):
        for fake, value in zip(fakes, reals, strict=True):
            if isinstance(fake, fake_tensor.FakeTensor) and isinstance(value, torch.Tensor):
                shadows.add(fake, value)


class _TraceFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that keeps real values beside fake tensors where it can know them (see
    the comment above) and runs the nested-tensor fast path of ``nn.TransformerEncoder`` (see
    ``_NestedStandIns``). Whatever enters this mode gets both: a trial, and a forward pass alone."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.shadows = _Shadows()
        self.nested = _NestedStandIns(self)

    def fake_like(self, shape: Any, dtype: torch.dtype, device: torch.device, stride: Any = None) -> torch.Tensor:
        """A new fake tensor (made inside this mode, so a counting mode above counts it as an output)."""
        with self:
            if stride is None:
                return torch.empty(tuple(shape), dtype=dtype, device=device)
            return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.nested.ids or func._schema.name in self.nested.ENTRIES:
            handled = self.nested.dispatch(func, args, kwargs)
            if handled is not _UNKNOWN:
                return handled
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException):
            real = _real_call(func, args, kwargs, self.shadows)
            if real is not _UNKNOWN:
                return self.from_real(real, _device_of(args))
            shaped = VALUE_SHAPED_OPS.get(func._schema.name)
            made = shaped(self, *args, **kwargs) if shaped is not None else _UNKNOWN
            if made is _UNKNOWN:
                raise
            return made
        self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` real values where its arguments have them; forget the values of what it
        writes with data the trace does not know."""
        known = _all_known(args, self.shadows) and (not kwargs or _all_known(kwargs.values(), self.shadows))
        wanted = known and isinstance(out, (torch.Tensor, list, tuple)) and _small(out)
        real = _real_call(func, args, kwargs, self.shadows) if wanted else _UNKNOWN
        if real is not _UNKNOWN:
            _attach(self.shadows, out, real)
        elif _written_arguments(func):
            for tensor in _written_tensors(func, args, kwargs):
                if id(tensor) in self.shadows._values:  # a view without kept values has a base without them
                    self.shadows.written(tensor)

    def value(self, tensor: Any) -> torch.Tensor | None:
        """The real values of ``tensor`` (itself when it is real), or ``None`` when unknown."""
        if isinstance(tensor, fake_tensor.FakeTensor):
            return self.shadows.get(tensor)
        if isinstance(tensor, (list, tuple)) and all(isinstance(item, int) for item in tensor):
            return torch.tensor(tensor, dtype=torch.int64)
        return tensor if isinstance(tensor, torch.Tensor) else None

    def from_real(self, real: Any, device: torch.device) -> Any:
        """Fake tensors of the real outputs' shapes on ``device`` (with those values kept), or the real value."""
        if isinstance(real, (list, tuple)):
            return type(real)(self.from_real(item, device) for item in real)
        if not isinstance(real, torch.Tensor):
            return real
        fake = self.fake_like(real.shape, real.dtype, device, real.stride())
        self.shadows.add(fake, real)
        return fake


def _device_of(args: tuple) -> torch.device:
    """The device the first fake argument claims (the CPU when there is none)."""
    return next((t.device for t in _leaves(args) if isinstance(t, fake_tensor.FakeTensor)), _CPU)


def _pack_padded(mode: _TraceFakeMode, input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> Any:
    """``aten._pack_padded_sequence`` (``pack_padded_sequence``): the packed rows are the sum of the
    lengths, whose values the trace keeps; the real kernel runs on a stand-in without data. The
    batch sizes stay real, as the recurrent layers' C++ reads them (a small host tensor, as in
    the real step)."""
    values = mode.value(lengths)
    if values is None or input.dim() < 2:
        return _UNKNOWN
    with _disable_current_modes():
        data, batch_sizes = torch._pack_padded_sequence(torch.zeros(()).expand(input.shape[:2]), values, batch_first)
    return mode.fake_like((data.shape[0], *input.shape[2:]), input.dtype, input.device), batch_sizes


def _ctc_loss(mode: _TraceFakeMode, log_probs: torch.Tensor, targets, input_lengths, target_lengths, *rest) -> Any:
    """``aten._ctc_loss`` (``nn.CTCLoss``): the loss per row and the alphas, (batch, time,
    2 * longest target + 1), the longest target read from the kept lengths."""
    values = mode.value(target_lengths)
    if values is None or log_probs.dim() != 3:
        return _UNKNOWN
    steps, rows = log_probs.shape[:2]
    width = 2 * int(values.max()) + 1 if values.numel() else 1
    return (
        mode.fake_like((rows,), log_probs.dtype, log_probs.device),
        mode.fake_like((rows, steps, width), log_probs.dtype, log_probs.device),
    )


# Ops whose output shapes depend on values the trace keeps, though not all their inputs have
# kept values (by name, any overload): each rule makes fake outputs of the real shapes, or
# returns ``_UNKNOWN``.
VALUE_SHAPED_OPS: dict[str, Callable[..., Any]] = {
    "aten::_pack_padded_sequence": _pack_padded,
    "aten::_ctc_loss": _ctc_loss,
}


class _NestedStandIns:
    """The nested-tensor fast path of ``nn.TransformerEncoder`` (eval with a padding mask) on fake
    tensors, which cannot be nested. The real step packs the unpadded tokens into one nested buffer
    (``aten._nested_tensor_from_mask``), runs each fused layer on it and pads the result back
    (``aten.to_padded_tensor``). Here the nested tensor is stood in for by a dense fake of shape
    (1, tokens, width): the same bytes as the nested buffer (the token count is read from the
    mask's real values), which each fused layer (``aten._transformer_encoder_layer_fwd``) maps
    to another stand-in, as the real kernel maps a nested buffer to one of the same size. Any other
    op on a stand-in is a ``TraceError``."""

    LAYER, FROM_MASK, ALIGNED, PADDED = (
        "aten::_transformer_encoder_layer_fwd",
        "aten::_nested_tensor_from_mask",
        "aten::_nested_tensor_from_mask_left_aligned",
        "aten::to_padded_tensor",
    )
    ENTRIES = frozenset((FROM_MASK, ALIGNED))  # the ops that start the fast path

    def __init__(self, mode: _TraceFakeMode) -> None:
        self.mode = mode
        self.ids: dict[int, weakref.ref] = {}
        self.inside = 0  # > 0 while a fused layer runs on a stand-in (its own ops are its business)

    def _add(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)
        self.ids[key] = weakref.ref(tensor, lambda _ref, k=key: self.ids.pop(k, None))
        return tensor

    def _is_stand_in(self, value: Any) -> bool:
        ref = self.ids.get(id(value))
        return ref is not None and ref() is value

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """What the fast path's op returns on the trace, or ``_UNKNOWN`` for an op it leaves alone."""
        name = func._schema.name
        if name == self.FROM_MASK:
            return self._from_mask(*args, **kwargs)
        if name == self.ALIGNED:
            return self._left_aligned(*args)
        if self.inside or not self.ids or not any(self._is_stand_in(a) for a in _leaves((args, kwargs))):
            return _UNKNOWN
        if name == self.PADDED:
            return self._padded(*args, **kwargs)
        if name != self.LAYER:
            raise TraceError(
                f"cannot trace this workload on fake tensors ({name} on the nested-tensor fast path of "
                "nn.TransformerEncoder); measure it with `batchfit find` on a real or simulated device instead"
            )
        self.inside += 1
        try:
            with self.mode:
                return self._add(func(*args, **kwargs))
        finally:
            self.inside -= 1

    def _mask_values(self, mask: torch.Tensor) -> torch.Tensor:
        real = self.mode.shadows.get(mask) if isinstance(mask, fake_tensor.FakeTensor) else mask
        if real is None:
            raise TraceError(
                "cannot trace this workload on fake tensors (the nested-tensor fast path of "
                "nn.TransformerEncoder needs the padding mask's values, which come from the parameters "
                "or exceed what the trace keeps); measure it with `batchfit find` on a real or simulated "
                "device instead, or trace it in train mode"
            )
        return real

    def _from_mask(self, t: torch.Tensor, mask: torch.Tensor, mask_check: bool = True) -> torch.Tensor:
        tokens = int(self._mask_values(mask).sum())
        return self._add(self.mode.fake_like((1, tokens, t.shape[-1]), t.dtype, t.device))

    def _left_aligned(self, t: torch.Tensor, mask: torch.Tensor) -> bool:
        values = self._mask_values(mask)
        with _disable_current_modes():  # only the mask's values matter: the input's shape, no data
            return bool(torch._nested_tensor_from_mask_left_aligned(torch.zeros(()).expand(t.shape), values))

    def _padded(self, nested: torch.Tensor, padding: float, output_size: Any = None) -> torch.Tensor:
        if output_size is None:
            raise TraceError(
                "cannot trace this workload on fake tensors (to_padded_tensor without an output size on "
                "the nested-tensor fast path); measure it with `batchfit find` on a real or simulated device instead"
            )
        return self.mode.fake_like(output_size, nested.dtype, nested.device)


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
    return out.untyped_storage().nbytes() < _nbytes(args[0])


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


class _UndercountWatch(TorchDispatchMode):
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


def trace_capacity_bytes(capacity: int | str, reserve_bytes: int | None = None) -> int:
    """Bytes from a size (``"40GiB"``) or a GPU preset name (``"a100-40gb"``)."""
    if isinstance(capacity, str) and is_preset(capacity):
        return usable_bytes(capacity, reserve_bytes)
    try:
        return parse_bytes(capacity)
    except ValueError:
        if not isinstance(capacity, str):
            raise
        names = ", ".join(ACCELERATORS)
        raise InputError(f"capacity {capacity!r} is neither a size like '40GiB' nor a GPU preset ({names})") from None


class _FakeWorkloadBuilder:
    """Copies a workload with fake tensors in place of real ones: nothing copied for real but the
    values the step may ask about (the sample and small buffers, see ``SHADOW_MAX_BYTES``)."""

    def __init__(self, mode: _TraceFakeMode):
        self.mode = mode

    def fake(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.mode.from_tensor(tensor, static_shapes=True)

    def data(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake of a tensor the step may ask for values (the sample, a buffer), with a real copy
        of them when small (a copy: the user's tensor is never written)."""
        fake = self.fake(tensor)
        if tensor.layout == torch.strided and _nbytes(tensor) <= SHADOW_MAX_BYTES:
            with _disable_current_modes():
                self.mode.shadows.add(fake, tensor.detach().to(_CPU, copy=True))
        return fake

    def constant(self, tensor: torch.Tensor) -> torch.Tensor:
        # Scalars such as Adam's `step` must answer .item(): a constant fake, built from a clone
        # because constant propagation writes into the tensor it was made from.
        return self.mode.fake_tensor_converter.from_real_tensor(self.mode, tensor.clone(), make_constant=True)

    def memo(self, work: Workload) -> dict[int, torch.Tensor]:
        memo: dict[int, torch.Tensor] = {}
        for param in work.model.parameters():
            fake = torch.nn.Parameter(self.fake(param), requires_grad=param.requires_grad)
            if param.grad is not None:
                fake.grad = self.fake(param.grad)
            memo[id(param)] = fake
        for buffer in work.model.buffers():
            memo[id(buffer)] = self.data(buffer)
        if work.optimizer is not None:
            for entries in work.optimizer.state.values():
                for value in entries.values():
                    if isinstance(value, torch.Tensor):
                        memo[id(value)] = self.constant(value) if value.numel() == 1 else self.fake(value)
        return memo

    def build(self, work: Workload) -> Workload:
        memo = self.memo(work)
        model = copy.deepcopy(work.model, memo)
        optimizer = copy.deepcopy(work.optimizer, memo) if work.optimizer is not None else None
        sample = map_tensors(self.data, work.sample_batch)
        return dataclasses.replace(work, model=model, optimizer=optimizer, sample_batch=sample)


class TraceDevice(CountingDevice):
    """Estimate without the hardware: ``capacity`` is bytes, a size such as ``"40GiB"``, or a GPU
    preset such as ``"a100-40gb"`` (its usable memory after the per-process reserve).

    Storages are rounded to 512-byte blocks like the CUDA caching allocator; ``reserved=True``
    also rounds requests over 1 MiB up to 2 MiB, a rough model of the allocator's reserved memory.
    ``device`` is where the fake tensors claim to be (the real device's type, so autocast picks
    the same kernels); the fake kernels run on the CPU.

    >>> TraceDevice("40GiB").capacity_bytes() == 40 * 2**30
    True
    """

    simulated = True

    def __init__(
        self,
        capacity: int | str,
        *,
        rounding_bytes: int = CUDA_BLOCK_BYTES,
        reserved: bool = False,
        reserve_bytes: int | None = None,
        device: torch.device | str = "cpu",
    ):
        self._capacity_bytes = trace_capacity_bytes(capacity, reserve_bytes)
        label = capacity if isinstance(capacity, str) and is_preset(capacity) else format_bytes(self._capacity_bytes)
        name = f"trace:{str(label).replace(' ', '')}"
        counter = LiveBytes(
            limit_bytes=self._capacity_bytes,
            rounding_bytes=rounding_bytes,
            name=name,
            large_rounding_bytes=CUDA_LARGE_ROUND_BYTES if reserved else None,
        )
        super().__init__(name, torch.device(device), counter)
        self.fake_mode = _TraceFakeMode()
        self._undercounted: dict[str, None] = {}  # ordered like first seen

    @property
    def undercounted_ops(self) -> tuple[str, ...]:
        """The ops this device has run whose fake output is smaller than the real one and could not
        be completed (see ``UNDERCOUNTING_OPS``): while any is listed, its peaks are lower bounds.

        >>> TraceDevice("1GiB").undercounted_ops
        ()
        """
        return tuple(self._undercounted)

    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def unlimited(self) -> TraceDevice:
        """A fresh TraceDevice like this one (rounding, reserved memory, device type) with no
        capacity limit, so a trace measures the whole peak; this device is left as it is.

        >>> TraceDevice("1GiB", reserved=True).unlimited().capacity_bytes() > 2**50
        True
        """
        return TraceDevice(
            UNLIMITED_BYTES,
            rounding_bytes=self.counter.rounding_bytes,
            reserved=self.counter.large_rounding_bytes is not None,
            device=self.torch_device,
        )

    def prepare(self, workload: Workload) -> Workload:
        """A copy of ``workload`` with fake tensors: what trials on this device run. A workload
        that cannot be copied (a lock, a generator, a tensor kind fake tensors lack) is a
        ``TraceError``: the real device needs no copy."""
        try:
            return _FakeWorkloadBuilder(self.fake_mode).build(super().prepare(workload))
        except Exception as error:
            raise trace_error(error) from error

    @contextlib.contextmanager
    def measuring(self, uncounted: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        # The workspaces computed for the fake (CPU) kernels are the CPU's: a trace for a GPU only records.
        watch = _UndercountWatch(self._undercounted, complete=self.torch_device.type == "cpu")
        if not _TRACED:
            _TRACED.append(True)  # this process has paid the fake mode's start-up (see traced_before)
        with self.fake_mode, self.counter.mode(uncounted), watch:
            yield


_TRACED: list[bool] = []  # one entry once any trace ran in this process; read by traced_before()


def traced_before() -> bool:
    """Whether a trace ran in this process already: the fake mode's one-time start-up (about 0.7 s
    on a 2-core CPU) is then paid, and a new trace costs only its ops."""
    return bool(_TRACED)


def as_trace_device(spec: TraceDevice | SimulatedDevice | int | str | None) -> TraceDevice | None:
    """The TraceDevice ``spec`` names for an estimate on fake tensors: a ``TraceDevice`` itself; a
    ``SimulatedDevice`` or ``"sim:CAPACITY"`` as a device of that capacity; ``"trace:CAPACITY"``,
    a GPU preset (``"a100-40gb"``) or a capacity (bytes or ``"40GiB"``); ``None`` stays ``None``
    (no capacity). Anything else is a ``ValueError`` naming what is accepted.

    >>> as_trace_device("sim:40GiB").capacity_bytes() == as_trace_device(40 * 2**30).capacity_bytes()
    True
    """
    if spec is None or isinstance(spec, TraceDevice):
        return spec
    if isinstance(spec, SimulatedDevice):
        return TraceDevice(spec.capacity_bytes(), rounding_bytes=spec.counter.rounding_bytes)
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise InputError(f"an estimate cannot run on device {spec!r} ({type(spec).__name__}): {TRACE_DEVICE_HELP}")
    capacity = spec
    if isinstance(spec, str) and spec.strip().lower().startswith(("sim:", "trace:")):
        capacity = spec.strip().split(":", 1)[1]
    try:
        return TraceDevice(capacity)
    except (ValueError, TypeError):
        presets = ", ".join(ACCELERATORS)
        raise InputError(
            f"an estimate cannot run on device {spec!r}: {TRACE_DEVICE_HELP} (presets: {presets})"
        ) from None
