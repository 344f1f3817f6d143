"""The Device protocol: where a probe runs and how its memory is read."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any
from typing import Protocol
from typing import runtime_checkable

import torch

from batchfit.devices.allocator_replay import SETTLE_STEPS
from batchfit.devices.allocator_replay import Replay
from batchfit.devices.allocator_replay import replay_loops
from batchfit.step.compiled import uncompiled


@runtime_checkable
class Device(Protocol):
    """What the search needs from a device.

    ``measuring()`` is active while a trial runs; peaks are absolute bytes (model included), of the
    tensors alive (what ``torch.cuda.max_memory_allocated`` reports); a device with a caching allocator
    (real, or modelled) may also give ``reserved_peak_bytes()``, what the allocator held from the device,
    and says its ``allocator_settings`` (``None``: none, or counted exactly).
    ``timeline()`` gives the live bytes after each op of the last ``measuring()`` block, or
    ``None`` where the device cannot record it; ``exact_timeline()`` the same before allocator
    rounding, where the device knows it. ``cleanup()`` frees what a trial left behind (young
    garbage, cached blocks); ``collect()`` also runs a full garbage collection. ``prepare()``
    returns the workload trials run on this device (a fake copy on the trace device);
    ``for_workload()`` returns the device as the trials of one workload measure it (the device
    itself, or a copy set up for that workload). Neither changes the device or the workload, so
    nothing carries over from one search to the next.
    """

    name: str
    torch_device: torch.device
    simulated: bool

    def capacity_bytes(self) -> int | None: ...
    def live_bytes(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak_bytes(self) -> int: ...
    def measuring(self, uncounted: Iterable[torch.Tensor] = ()) -> contextlib.AbstractContextManager: ...
    def timeline(self) -> list[int] | None: ...
    def exact_timeline(self) -> list[int] | None: ...
    def register(self, tensors: Iterable[torch.Tensor]) -> None: ...
    def cleanup(self) -> None: ...
    def collect(self) -> None: ...
    def prepare(self, workload: Any) -> Any: ...
    def for_workload(self, workload: Any) -> Device: ...
    def synchronize(self) -> None: ...


class CountingDevice:
    """Shared base for devices whose memory is read by live-bytes accounting (CPU, MPS, simulated)."""

    simulated = False
    allocator_settings = None  # a simulated device's modelled caching allocator, if any

    def __init__(self, name: str, torch_device: torch.device, counter) -> None:
        self.name = name
        self.torch_device = torch_device
        self.counter = counter

    def live_bytes(self) -> int:
        return self.counter.live_bytes

    def reset_peak(self) -> None:
        self.counter.reset_peak()

    def peak_bytes(self) -> int:
        return self.counter.peak_bytes

    def reserved_peak_bytes(self) -> int | None:
        """The modelled caching allocator's reserved peak since ``reset_peak`` (``None`` without one)."""
        return self.counter.peak_reserved_bytes

    @contextlib.contextmanager
    def measuring(self, uncounted: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Count what ops read and make; ``uncounted`` tensors (host data such as the sample a
        batch is built from, which never lives on a GPU) and their views are never counted."""
        with self.counter.mode(uncounted):
            yield

    def timeline(self) -> list[int]:
        return self.counter.timeline

    def exact_timeline(self) -> list[int]:
        return self.counter.exact_timeline

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        self.counter.track_all(tensors)

    def prepare(self, workload: Any) -> Any:
        """What trials run: a ``torch.compile``d model as its original module (see ``batchfit.step.compiled``)."""
        return uncompiled(workload)

    def for_workload(self, workload: Any) -> CountingDevice:
        """This device: its accounting is the same for every (prepared) workload."""
        return self

    def cleanup(self) -> None:
        gc.collect(1)
        self.counter.empty_cache()  # a modelled caching allocator's, as a GPU's cleanup empties its cache

    def collect(self) -> None:
        gc.collect()
        self.cleanup()

    def synchronize(self) -> None:
        return None

    def host(self) -> contextlib.AbstractContextManager:
        """Where a trial builds its rows before copying them in each step, as a loader's batch is built on the
        host: nothing here counts (ops run as they would outside ``measuring``)."""
        return contextlib.nullcontext()

    def mark(self, label: str) -> None:
        """Note in the allocator's event log that a step begins (``"step"``), the last one ended (``"end"``), or
        a phase ended (its name): what ``loop_replay`` needs to run the loop on."""
        self.counter.mark(label)

    def loop_replay(self, settle_steps: int = SETTLE_STEPS) -> Replay | None:
        """The trial just measured, replayed through the modelled caching allocator and then run on, its last
        step again and again, until the allocator settles (``batchfit.devices.allocator_replay``), as each
        order of loop frees its memory (``batchfit.devices.loop_orders``); ``None``
        without a modelled allocator (bytes counted exactly: every step is served as the first was)."""
        counter = self.counter
        if counter.allocator is None or counter.allocator_at_start is None:
            return None
        _, _, nbytes = counter.storage_log()
        start = counter.allocator_at_start
        return replay_loops(start, counter.event_log(), nbytes, marks=counter.step_marks(), settle_steps=settle_steps)

    def __repr__(self) -> str:
        return self.name
