"""TraceDevice: the simulated device's accounting with nothing computed and nothing allocated.

The workload is copied with every tensor replaced by a fake one (``FakeTensorMode``, CPU
kernels: shapes, dtypes and storages, no data), so a trial at batch 4096 costs about what one
at batch 1 costs. The meta device is not used: it decomposes scaled-dot-product attention and
over-counts transformers. The user's model and optimizer are never touched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.base import CountingDevice
from batchfit.devices.presets import ACCELERATORS
from batchfit.devices.presets import is_preset
from batchfit.devices.presets import usable_bytes
from batchfit.devices.simulated import CUDA_BLOCK_BYTES
from batchfit.devices.simulated import SimulatedDevice
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
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


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Turn what fake tensors cannot do into a ``TraceError`` that says why; the user's own
    ``ValueError``/``TypeError`` and ``KeyboardInterrupt`` pass unchanged."""
    try:
        yield
    except (ValueError, TypeError):
        raise
    except Exception as error:
        if isinstance(error, NoBatchFitsError):
            raise
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        raise TraceError(
            f"cannot trace this workload on fake tensors ({type(error).__name__}: {reason}); "
            "measure it with `batchfit find` on a real or simulated device instead"
        ) from error


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
        raise ValueError(f"capacity {capacity!r} is neither a size like '40GiB' nor a GPU preset ({names})") from None


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
        """A copy of ``workload`` with fake tensors: what trials on this device run."""
        return _FakeWorkloadBuilder(self.fake_mode).build(super().prepare(workload))

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        with self.fake_mode, self.counter.mode():
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
        raise ValueError(f"an estimate cannot run on device {spec!r} ({type(spec).__name__}): {TRACE_DEVICE_HELP}")
    capacity = spec
    if isinstance(spec, str) and spec.strip().lower().startswith(("sim:", "trace:")):
        capacity = spec.strip().split(":", 1)[1]
    try:
        return TraceDevice(capacity)
    except (ValueError, TypeError):
        presets = ", ".join(ACCELERATORS)
        raise ValueError(
            f"an estimate cannot run on device {spec!r}: {TRACE_DEVICE_HELP} (presets: {presets})"
        ) from None
