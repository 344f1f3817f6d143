"""batchfit's own runs as PyTorch memory snapshots: the file ``torch.cuda.memory._dump_snapshot`` writes, made from
the caching allocator model instead of a GPU, so torch's viewer (``torch.cuda._memory_viz``, pytorch.org/memory_viz)
draws what the model did and ``batchfit allocator`` can replay it.

The format is torch's (``torch.cuda.memory._snapshot`` documents it; ``torch/csrc/cuda/memory_snapshot.cpp`` writes
it; ``torch/cuda/_memory_viz.py`` and ``torch/utils/viz/MemoryViz.js`` read it; torch 2.13): a dict of

- ``segments``: the allocator's state when the snapshot is taken, each segment (one ``cudaMalloc``; with expandable
  segments each run of mapped pages) with its ``device``, ``address``, ``total_size``, ``allocated_size``,
  ``active_size``, ``requested_size``, ``stream``, ``segment_type`` (``small`` or ``large``), ``segment_pool_id``,
  ``is_expandable``, ``frames`` and ``blocks`` in address order (``address``, ``size``, ``requested_size``,
  ``state``: ``active_allocated`` or ``inactive``, ``frames``);
- ``device_traces``: per device, every event since recording began, in order: ``action`` (``alloc``,
  ``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``,
  ``oom``), ``addr`` (for ``oom``: ``device_free``), ``size``, ``stream``, ``time_us``, ``frames``;
- ``allocator_settings``: the ``PYTORCH_CUDA_ALLOC_CONF`` string and the settings torch read from it.

What the model cannot know is left empty: no stack frames (every ``frames`` list is empty, which also keeps the
file small), one stream (0), the default pools (``segment_pool_id`` ``(0, 0)``), and ``time_us`` counts events.
Each free is written as torch writes a free on one stream: ``free_requested`` then ``free_completed``. Addresses
are the model's, moved up by ``BASE_ADDRESS`` (the viewer reads an address of 0 as none). A ``batchfit`` entry,
which torch's readers ignore, says where the snapshot came from: the device, its capacity, the batch size.

A trial's snapshot (``memory_snapshot``) begins where the trial began, with the model and optimizer already on the
device, as a snapshot recorded from a training loop's first step does: its trace holds the trial's requests and
frees as the device's modelled allocator served them (the trial's event log run again through its allocator's
state when the trial began: ``LiveBytes.event_log``), then, as ``batchfit.devices.allocator_replay`` runs it, the
loop's last step again and again until the allocator settles or a request fails (the loop order that fails first).
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from batchfit.devices.allocator_events import RecordingAllocator
from batchfit.devices.allocator_replay import SETTLE_STEPS
from batchfit.devices.allocator_replay import SteadyStep
from batchfit.devices.allocator_replay import StepSpans
from batchfit.devices.allocator_replay import replay_loops
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.allocator_settings import allocator_label
from batchfit.devices.caching_allocator import Block
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.loop_orders import TRIAL_ORDER
from batchfit.devices.loop_orders import reordered
from batchfit.errors import InputError
from batchfit.files import atomic_write_bytes

BASE_ADDRESS = 0x7F00_0000_0000  # where the model's address 0 lands in a snapshot
PICKLE_PROTOCOL = 4  # what torch's _dump_snapshot writes, and the newest MemoryViz.js unpickles
SIZE_MAX_AS_INT64 = -1  # torch writes max_split_size's "unlimited" (SIZE_MAX) cast to int64


def memory_snapshot(
    device: Any, *, batch_size: int | None = None, run_on: bool = True, settle_steps: int = SETTLE_STEPS
) -> dict[str, Any]:
    """The last trial ``device`` measured (a ``SimulatedDevice`` or ``TraceDevice`` modelling the CUDA caching
    allocator) as a PyTorch memory snapshot (see the module's docstring). ``run_on`` adds the steps the allocator
    model runs the loop on for (up to ``settle_steps``), as the trial's verdict does; ``batch_size`` is noted.
    An ``InputError`` where the device models no caching allocator, or has measured no trial."""
    counter = getattr(device, "counter", None)
    if counter is None or getattr(counter, "allocator", None) is None:
        raise InputError(
            f"a memory snapshot needs a device that models the CUDA caching allocator, not {device!r}: use "
            "sim:CAPACITY:cuda (or a SimulatedDevice/TraceDevice with allocator='cuda'), or a GPU preset"
        )
    if counter.allocator_at_start is None:
        raise InputError(f"{device!r} has measured no trial yet: run one (probe_batch_size) before its snapshot")
    recorder, loop = recorded_trial(counter, run_on=run_on, settle_steps=settle_steps)
    about = {"device": getattr(device, "name", str(device)), "batch_size": batch_size, **loop}
    return snapshot_of(recorder, about)


def dump_memory_snapshot(device: Any, path: str | Path, **options: Any) -> Path:
    """``memory_snapshot(device, **options)`` pickled to ``path`` as ``torch.cuda.memory._dump_snapshot`` does."""
    return write_snapshot(memory_snapshot(device, **options), path)


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """``snapshot`` pickled to ``path`` (protocol 4, as torch writes it and its viewer reads it), atomically."""
    return atomic_write_bytes(path, pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL))


CUDA_MAX_ENTRIES = 1_000_000  # the events torch keeps while a trial on a GPU records (a ring buffer)


@contextlib.contextmanager
def recording_cuda_history(max_entries: int = CUDA_MAX_ENTRIES) -> Any:
    """torch's allocator history recorded while active, with no stack frames (``context=None``: a small file);
    yields a function that takes the snapshot (``torch.cuda.memory._snapshot``). Recording stops on the way out."""
    import torch

    memory = torch.cuda.memory
    memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=max_entries)
    try:
        yield memory._snapshot
    finally:
        memory._record_memory_history(enabled=None)


def snapshot_refusal(device: Any) -> str | None:
    """Why ``device`` cannot write a memory snapshot (one line), or ``None`` where it can: a CUDA GPU, or a device
    that models the CUDA caching allocator."""
    from batchfit.devices.cuda import CudaDevice

    if isinstance(device, CudaDevice) or getattr(device, "allocator_settings", None) is not None:
        return None
    return (
        f"--memory-snapshot needs the CUDA caching allocator, which {getattr(device, 'name', device)} does not "
        "model: use a CUDA GPU, a simulated device with it (--device sim:CAPACITY:cuda), or an estimate with "
        "--allocator cuda"
    )


# -- the trial, run again through a recording allocator ----------------------------------------------------------


def recorded_trial(counter: Any, *, run_on: bool, settle_steps: int) -> tuple[RecordingAllocator, dict[str, Any]]:
    """The counter's last trial served again by a ``RecordingAllocator`` from the allocator's state when it began:
    its whole steps (all it logged, up to the request that failed, where it stopped short), then with ``run_on``
    its last step again and again, as the loop order that runs out of memory first, until the allocator's state
    repeats, a request fails, or ``settle_steps`` steps ran. Also what ran: steps, the loop order, the step that
    failed."""
    start: CachingAllocator = counter.allocator_at_start
    events, marks, sizes = counter.event_log(), counter.step_marks(), counter.storage_log()[2]
    spans = StepSpans.of(marks)
    order = TRIAL_ORDER
    if spans is not None and run_on and settle_steps > 0:
        order = replay_loops(start, events, sizes, marks=marks, settle_steps=settle_steps).loop or TRIAL_ORDER
        events, marks = reordered(events, marks, order)
        spans = StepSpans.of(marks)
    recorder = RecordingAllocator.of(start)
    blocks: list[Block | None] = [None] * len(sizes)
    stop = spans.ends[-1] if spans is not None else len(events)
    failed_at = _serve(recorder, events[:stop].tolist(), sizes, blocks)
    steps = len(spans.begins) if spans is not None else None
    about: dict[str, Any] = {"capacity_bytes": start.capacity_bytes, "steps": steps, "loop_steps": steps}
    about["allocator"] = allocator_label(start.settings)
    if failed_at is not None:
        about["failed_step"] = spans.step_of(failed_at) if spans is not None else None
        return recorder, about
    if spans is None or not run_on or settle_steps <= 0:
        return recorder, about
    steady = SteadyStep.of(events, spans.begins[-1], spans.ends[-1], sizes)
    if steady is None:
        return recorder, about
    ran, settled, failed = _run_on(recorder, steady, sizes, blocks, settle_steps)
    about |= {"loop_steps": steps + ran, "settled": settled, "loop_order": order.describe()}
    if failed:
        about["failed_step"] = steps + ran
    return recorder, about


def _serve(allocator: CachingAllocator, events: list[int], sizes: np.ndarray, blocks: list[Block | None]) -> int | None:
    """``events`` served in order (as ``allocator_replay`` serves them); the position of the first request that
    failed (the allocator stops there, as the trial did), or ``None``."""
    for position, event in enumerate(events):
        if event > 0:
            block = allocator.malloc(int(sizes[event - 1]))
            if block is None:
                return position
            blocks[event - 1] = block
        elif (block := blocks[-event - 1]) is not None:
            allocator.free(block)
            blocks[-event - 1] = None
    return None


def _run_on(
    allocator: CachingAllocator,
    steady: SteadyStep,
    sizes: np.ndarray,
    blocks: list[Block | None],
    settle_steps: int,
) -> tuple[int, bool, bool]:
    """The steady step again and again, each freeing what the one before kept (``allocator_replay._settle``):
    the steps run, whether the allocator's state repeated, whether a request failed."""
    kept = [blocks[i] for i in steady.kept]
    partner = {before: steady.kept.index(now) for before, now in steady.freed_before.items()}
    seen = {allocator.state_key({id(b): n for n, b in enumerate(kept) if b is not None})}
    for step in range(1, settle_steps + 1):
        made: dict[int, Block] = {}
        for event in steady.events:
            if event > 0:
                block = allocator.malloc(int(sizes[event - 1]))
                if block is None:
                    return step, False, True
                made[event - 1] = block
            elif -event - 1 in made:
                allocator.free(made.pop(-event - 1))
            elif (held := kept[partner[-event - 1]]) is not None:
                allocator.free(held)
        kept = [made[i] for i in steady.kept]
        key = allocator.state_key({id(b): n for n, b in enumerate(kept) if b is not None})
        if key in seen:
            return step, True, False
        seen.add(key)
    return settle_steps, False, False


# -- torch's format ----------------------------------------------------------------------------------------------


def snapshot_of(recorder: RecordingAllocator, about: dict[str, Any] | None = None) -> dict[str, Any]:
    """The snapshot of ``recorder``: its segments now and every event it recorded (see the module's docstring)."""
    trace: list[dict[str, Any]] = []
    for event in recorder.events:
        if event.action == "free_completed":  # one stream: the free is requested and completed at once
            trace.append(_entry("free_requested", event.addr, event.size, len(trace)))
        trace.append(_entry(event.action, event.addr, event.size, len(trace), event.device_free))
    return {
        "segments": segments_of(recorder),
        "device_traces": [trace],
        "allocator_settings": settings_entry(recorder.settings),
        "external_annotations": [],
        "batchfit": dict(about or {}),
    }


def _entry(action: str, addr: int, size: int, time: int, device_free: int | None = None) -> dict[str, Any]:
    where = {"device_free": device_free} if action == "oom" else {"addr": BASE_ADDRESS + addr}
    return {"action": action, **where, "size": size, "stream": 0, "time_us": time, "frames": []}


def segments_of(allocator: CachingAllocator) -> list[dict[str, Any]]:
    """The allocator's segments as torch's ``snapshot()`` lists them, in address order: one per segment, and for
    an expandable segment one per run of mapped pages."""
    requested = getattr(allocator, "requested_size", lambda block: block.size)
    blocks = [*allocator.active]
    for pool in (allocator.small, allocator.large):
        blocks += [*pool.blocks.values(), *pool.unmapped.values()]
    segments = []
    for head in (b for b in blocks if b.prev is None):
        run: list[Block] = []
        block: Block | None = head
        while block is not None:
            if block.mapped:
                run.append(block)
            if run and (not block.mapped or block.next is None):
                segments.append(_segment(run, requested))
                run = []
            block = block.next
    return sorted(segments, key=lambda segment: segment["address"])


def _segment(run: list[Block], requested: Any) -> dict[str, Any]:
    held = [b for b in run if b.allocated]
    return {
        "device": 0,
        "address": BASE_ADDRESS + run[0].ptr,
        "total_size": sum(b.size for b in run),
        "allocated_size": sum(b.size for b in held),
        "active_size": sum(b.size for b in held),
        "requested_size": sum(requested(b) for b in held),
        "stream": 0,
        "segment_type": "small" if run[0].pool.small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": run[0].expandable,
        "frames": [],
        "blocks": [
            {
                "address": BASE_ADDRESS + b.ptr,
                "size": b.size,
                "requested_size": requested(b) if b.allocated else 0,
                "state": "active_allocated" if b.allocated else "inactive",
                "frames": [],
            }
            for b in run
        ],
    }


def settings_entry(settings: AllocatorSettings) -> dict[str, Any]:
    """``allocator_settings`` as torch writes it (``memory_snapshot.cpp``): the string, and what it sets."""
    divisions = {str(2**i): int(d) for i, d in enumerate(settings.roundup_divisions)}
    limit = settings.max_split_size_bytes
    return {
        "PYTORCH_CUDA_ALLOC_CONF": settings.to_conf(),
        "max_split_size": SIZE_MAX_AS_INT64 if limit is None else limit,
        "garbage_collection_threshold": float(settings.garbage_collection_threshold),
        "expandable_segments": settings.expandable_segments,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "graph_capture_record_stream_reuse": False,
        "roundup_power2_divisions": divisions,
    }
