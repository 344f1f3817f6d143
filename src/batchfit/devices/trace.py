"""TraceDevice: the simulated device's accounting with nothing computed and nothing allocated.

The workload is copied with every tensor replaced by a fake one (``FakeTensorMode``, CPU
kernels: shapes, dtypes and storages, no data), so a trial at batch 4096 costs about what one
at batch 1 costs. The meta device is not used: it decomposes scaled-dot-product attention and
over-counts transformers. The user's model and optimizer are never touched.

Two guards keep the trace honest. An op whose fake kernel makes less than the real one (the CPU
LSTM's workspace, see ``UNDERCOUNTING_OPS``) is recorded in ``TraceDevice.undercounted_ops``, so
an estimate can say it is a lower bound. And an error on fake tensors is sorted by
``is_users_error``: the user's own ``ValueError``/``TypeError`` (it would raise on the real
device too) against what fake tensors cannot do (a ``TraceError``: fall back to real probing).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._python_dispatch import TorchDispatchMode

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
    # whenever grad mode is on (none under no_grad); the fake kernel's workspace is always empty.
    return torch.is_grad_enabled() and out[3] is not None and out[3].numel() == 0


# Ops whose fake kernel makes less memory than the real one, measured by comparing the storage
# bytes of every output, real against fake, for the forward and backward of nn.LSTM (with
# layers, bidirectional, under bf16 autocast), nn.GRU, nn.RNN, nn.LSTMCell, nn.MultiheadAttention,
# scaled_dot_product_attention (with dropout), nn.TransformerEncoderLayer, convolutions, batch,
# layer and group norm, pooling, upsampling, dropout and embeddings on CPU: only this op differs
# (an LSTM with proj_size runs without it). Name -> (is the output under-counted?, what is missing).
UNDERCOUNTING_OPS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "aten::mkldnn_rnn_layer": (_rnn_workspace_missing, "the LSTM workspace kept for backward"),
}


class _UndercountWatch(TorchDispatchMode):
    """Records the ops of ``UNDERCOUNTING_OPS`` whose fake output is smaller than the real one."""

    def __init__(self, seen: dict[str, None]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        guard = UNDERCOUNTING_OPS.get(func.name())
        if guard is not None and guard[0](out):
            self.seen[func.name()] = None
        return out


def undercount_message(ops: tuple[str, ...] | list[str]) -> str:
    """Which ops the trace under-counts and what their fake kernels leave out, in one clause.

    >>> undercount_message(["aten::mkldnn_rnn_layer"])
    'the trace under-counts aten::mkldnn_rnn_layer (the LSTM workspace kept for backward), so the real peak is higher'
    """
    parts = ", ".join(f"{op} ({UNDERCOUNTING_OPS[op][1] if op in UNDERCOUNTING_OPS else 'its output'})" for op in ops)
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
        """The ops this device has run whose fake output is smaller than the real one (see
        ``UNDERCOUNTING_OPS``): while any is listed, its peaks are lower bounds.

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
        with self.fake_mode, self.counter.mode(uncounted), _UndercountWatch(self._undercounted):
            yield


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
