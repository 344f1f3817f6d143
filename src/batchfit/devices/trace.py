"""TraceDevice: the simulated device's accounting with nothing computed and nothing allocated.

The workload is copied with every tensor replaced by a fake one (``FakeTensorMode``, CPU
kernels: shapes, dtypes and storages, no data), so a trial at batch 4096 costs about what one
at batch 1 costs. The meta device is not used: it decomposes scaled-dot-product attention and
over-counts transformers. The user's model and optimizer are never touched.

Two guards keep the trace honest. An op whose fake kernel makes less than the real one (the CPU
LSTM's workspace, see ``UNDERCOUNTING_OPS``) gets what it lacks where its size is known (the
LSTM's, from ``lstm_workspace_bytes``), counted like any output; where it is not (an unmeasured
dtype, a torch build whose kernel disagrees), the op is recorded in
``TraceDevice.undercounted_ops``, so an estimate can say it is a lower bound. And an error on fake tensors is sorted by
``is_users_error``: the user's own ``ValueError``/``TypeError`` (it would raise on the real
device too) against what fake tensors cannot do (a ``TraceError``: fall back to real probing).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
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


def _rnn_workspace_missing(out: Any) -> bool:
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


class Undercount(NamedTuple):
    """An op whose fake kernel makes less than the real one: ``missing(out)`` says whether this
    output is short, ``what`` names what is missing, ``complete(func, args, kwargs, out)`` returns
    the output made whole (counted like any other) or ``None`` when the missing size is unknown."""

    missing: Callable[[Any], bool]
    what: str
    complete: Callable[[Any, tuple, dict, Any], Any]


# Ops whose fake kernel makes less memory than the real one, measured by comparing the storage
# bytes of every output, real against fake, for the forward and backward of nn.LSTM (with
# layers, bidirectional, under bf16 autocast), nn.GRU, nn.RNN, nn.LSTMCell, nn.MultiheadAttention,
# scaled_dot_product_attention (with dropout), nn.TransformerEncoderLayer, convolutions, batch,
# layer and group norm, pooling, upsampling, dropout and embeddings on CPU: only this op differs
# (an LSTM with proj_size runs without it). The trace completes it where its size is known.
UNDERCOUNTING_OPS: dict[str, Undercount] = {
    "aten::mkldnn_rnn_layer": Undercount(
        _rnn_workspace_missing, "the LSTM workspace kept for backward", _rnn_with_workspace
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
        out = func(*args, **kwargs)
        entry = UNDERCOUNTING_OPS.get(func.name())
        if entry is None or not entry.missing(out):
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
    """Copies a workload with fake tensors in place of real ones (nothing copied for real)."""

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode

    def fake(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.mode.from_tensor(tensor, static_shapes=True)

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
            memo[id(buffer)] = self.fake(buffer)
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
        sample = map_tensors(self.fake, work.sample_batch)
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
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
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
