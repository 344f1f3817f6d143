"""MlxDevice: where an MLX probe runs, its capacity, and MLX's memory counters; MLX's OOM classifier.

MLX counts every live array's bytes (``mx.get_active_memory``) and keeps the peak since
``mx.reset_peak_memory``, which resets it to zero, not to what is live: a trial's peak is the
larger of the two, so, as for torch, it includes the parameters and optimizer state held.
MLX does not raise when its memory limit is passed (it waits, then allocates anyway), so a trial
fits when its peak stays under the capacity minus the margin; an allocation failure that MLX does
raise is an out-of-memory trial too.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from batchfit.devices.cpu import available_host_bytes
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError

DEVICE_HELP = (
    "for MLX use 'auto', 'mlx' (Apple silicon: its recommended working set) or 'mlx:CAPACITY' (e.g. 'mlx:8GiB')"
)
DEFAULT_CAPACITY = "256MiB"  # without Metal, as for torch's simulated device: a demo on two CPU cores takes seconds

# Each entry names where MLX writes it.
MLX_OOM_MESSAGES: tuple[str, ...] = (
    "[malloc] Unable to allocate",  # mlx/allocator.cpp: the backend's allocator (Metal, CUDA, CPU) gave no buffer
    "[malloc_or_wait] Unable to allocate",  # older MLX: still no buffer after waiting for work in flight
    "[metal::malloc] Attempting to allocate",  # Metal: one buffer over the GPU's maximum buffer length
    "Command buffer execution failed: Insufficient Memory",  # Metal: the GPU ran out of memory mid-command
)


def is_mlx_oom(error: BaseException) -> bool:
    """True only for an MLX out-of-memory error (a ``RuntimeError`` with one of the messages above).

    >>> is_mlx_oom(RuntimeError("[malloc] Unable to allocate 4294967296 bytes."))
    True
    >>> is_mlx_oom(ValueError("[malloc] Unable to allocate 8 bytes."))
    False
    """
    return isinstance(error, RuntimeError) and any(known in str(error) for known in MLX_OOM_MESSAGES)


def recommended_working_set_bytes() -> int | None:
    """Metal's recommended working-set size, or ``None`` where there is no Metal GPU."""
    if not mx.metal.is_available():
        return None
    info_of = getattr(mx, "device_info", None)  # older MLX has only mx.metal.device_info
    info = info_of(mx.gpu) if info_of is not None else mx.metal.device_info()
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


class MlxDevice:
    """An MLX device with a memory capacity: on Apple silicon, by default, Metal's recommended
    working set; elsewhere the one you give (``"256MiB"``, ``"8GiB"``, or bytes), which must fit
    in the machine's memory (MLX on Linux does not raise past it: the process dies).
    ``device`` is ``"gpu"`` or ``"cpu"`` (default: MLX's default device).

    >>> MlxDevice("64MiB").capacity_bytes()
    67108864
    """

    torch_device = None  # part of the Device protocol; an MLX device has no torch device

    def __init__(self, capacity: int | str | None = None, *, device: str | None = None) -> None:
        if device not in (None, "cpu", "gpu"):
            raise InputError(f"device must be 'cpu', 'gpu' or None (MLX's default), got {device!r}")
        self.mlx_device = mx.default_device() if device is None else mx.Device(getattr(mx, device))
        on_gpu = self.mlx_device.type == mx.gpu
        if capacity is None:
            self._capacity_bytes = _own_capacity()
        else:
            self._capacity_bytes = _given_capacity(capacity, on_gpu)
        kind = "gpu" if on_gpu else "cpu"
        self.simulated = capacity is not None and not on_gpu
        given = f":{format_bytes(self._capacity_bytes).replace(' ', '')}" if capacity is not None else ""
        self.name = f"mlx:{kind}{given}"
        self._live_at_reset = 0

    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def live_bytes(self) -> int:
        return mx.get_active_memory()

    def reset_peak(self) -> None:
        self._live_at_reset = mx.get_active_memory()
        mx.reset_peak_memory()

    def peak_bytes(self) -> int:
        """The peak since ``reset_peak``: MLX resets its own to zero, so what was live then is a floor."""
        return max(mx.get_peak_memory(), self._live_at_reset)

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        with mx.stream(self.mlx_device):
            yield

    def timeline(self) -> None:
        return None

    def exact_timeline(self) -> None:
        return None

    def register(self, tensors: Iterable[Any]) -> None:
        return None  # MLX counts every array itself

    def cleanup(self) -> None:
        gc.collect(1)
        self.synchronize()
        mx.clear_cache()

    def collect(self) -> None:
        gc.collect()
        self.cleanup()

    def prepare(self, workload: Any) -> Any:
        if getattr(workload, "framework", None) != "mlx":
            raise InputTypeError(
                f"{self.name} runs MLX workloads (batchfit.integrations.mlx.MlxWorkload), got {type(workload).__name__}"
            )
        return workload

    def for_workload(self, workload: Any) -> MlxDevice:
        """This device: it measures every workload the same way."""
        return self

    def synchronize(self) -> None:
        mx.synchronize()

    def __repr__(self) -> str:
        return self.name


def _own_capacity() -> int:
    size = recommended_working_set_bytes()
    if size is None:
        raise InputError(
            "MLX reports no recommended working set here (no Metal GPU): give a capacity, "
            "e.g. MlxDevice('8GiB') or --device mlx:8GiB"
        )
    return size


def _given_capacity(capacity: int | str, on_gpu: bool) -> int:
    size = parse_bytes(capacity)
    host = None if on_gpu else available_host_bytes()
    if host is not None and size > host:
        raise InputError(
            f"capacity {format_bytes(size)} is more than this machine has free ({format_bytes(host)}): "
            "MLX on the CPU does not raise past it, the process dies; give a smaller capacity"
        )
    return size


def resolve_mlx_device(spec: Any) -> MlxDevice:
    """The ``MlxDevice`` for ``None``/``"auto"`` (Metal's working set, else ``DEFAULT_CAPACITY`` given),
    ``"mlx"``/``"gpu"`` (Metal's working set), ``"mlx:8GiB"``/``"sim:8GiB"`` or an ``MlxDevice``.

    >>> resolve_mlx_device("mlx:1GiB").capacity_bytes()
    1073741824
    """
    if isinstance(spec, MlxDevice):
        return spec
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "auto"):
        return MlxDevice() if recommended_working_set_bytes() is not None else MlxDevice(DEFAULT_CAPACITY)
    if not isinstance(spec, str):
        raise InputTypeError(
            f"device must be a string or an MlxDevice for an MLX workload, got {type(spec).__name__}: {DEVICE_HELP}"
        )
    text = spec.strip().lower()
    if text in ("mlx", "gpu", "metal"):
        return MlxDevice(device="gpu")
    for prefix in ("mlx:", "sim:"):
        if text.startswith(prefix):
            return MlxDevice(spec.strip()[len(prefix) :])
    raise InputError(f"unknown device {spec!r} for an MLX workload: {DEVICE_HELP}")
