"""CudaDevice: NVIDIA (and ROCm, which PyTorch exposes as ``cuda``) through the caching allocator."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.step.compiled import is_compiled


class _AllocatedTimeline(TorchDispatchMode):
    """Reads the allocator's live bytes after every op (host-side bookkeeping, no sync)."""

    def __init__(self, device: torch.device, timeline: list[int]):
        super().__init__()
        self.device = device
        self.timeline = timeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.timeline.append(torch.cuda.memory_allocated(self.device))
        return out


class CudaDevice:
    """Probe on a CUDA device; memory from the caching allocator's statistics.

    Capacity is what this process can still use: the driver's free memory plus what the
    allocator already holds in its cache. Trials report the allocator's reserved peak beside the
    allocated one, and every trial starts from an emptied cache (``cleanup``). With ``record_timeline`` (default) the live bytes are
    read after every op, which lets the memory model see each op's line. A compiled model is
    probed compiled, so without the timeline: ``for_workload`` gives the device its trials use.
    """

    simulated = False

    def __init__(self, index: int | None = None, *, record_timeline: bool = True) -> None:
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        self.name = f"cuda:{self.index}"
        self.record_timeline = record_timeline
        self._timeline: list[int] = []

    def capacity_bytes(self) -> int:
        free_bytes, _total_bytes = torch.cuda.mem_get_info(self.torch_device)
        return free_bytes + torch.cuda.memory_reserved(self.torch_device)

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.torch_device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)

    def reserved_peak_bytes(self) -> int:
        """What the caching allocator held from the GPU at most since ``reset_peak``: the edge is here."""
        return torch.cuda.max_memory_reserved(self.torch_device)

    @property
    def allocator_settings(self) -> AllocatorSettings:
        """The caching allocator's settings in this process (``PYTORCH_CUDA_ALLOC_CONF``, as torch parsed it)."""
        return AllocatorSettings.from_process()

    def measuring(self, uncounted: Iterable[torch.Tensor] = ()) -> contextlib.AbstractContextManager:
        """The allocator counts what is on this GPU; ``uncounted`` (host data) never is."""
        self._timeline = []
        if not self.record_timeline:
            return contextlib.nullcontext()
        return _AllocatedTimeline(self.torch_device, self._timeline)

    def timeline(self) -> list[int] | None:
        return self._timeline if self.record_timeline else None

    def exact_timeline(self) -> None:
        return None  # the allocator reports rounded blocks only

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        return None  # the allocator already counts every tensor on the device

    def prepare(self, workload: Any) -> Any:
        """The workload as given: a compiled model is probed compiled (see ``for_workload``)."""
        return workload

    def for_workload(self, workload: Any) -> CudaDevice:
        """The device the trials of ``workload`` measure with: this one, or for a compiled model a
        copy without the per-op timeline (dynamo would skip a model called under its dispatch mode
        for good, see ``batchfit.step.compiled``). This device is never changed."""
        if not self.record_timeline or not is_compiled(workload.model):
            return self
        view = copy.copy(self)
        view.record_timeline = False
        view._timeline = []
        return view

    def cleanup(self) -> None:
        gc.collect(1)
        torch.cuda.empty_cache()

    def collect(self) -> None:
        gc.collect()
        self.cleanup()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def __repr__(self) -> str:
        return self.name
