"""Read a PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot``, or ``batchfit.devices.memory_snapshots``):
its trace as events, the allocator settings and capacity it names, for ``batchfit.devices.snapshot_state`` (the
allocator's state when the trace began) and ``batchfit.devices.snapshot_replay``.

The file is a pickle of builtins only (dicts, lists, strings, numbers: ``torch/csrc/cuda/memory_snapshot.cpp``
writes nothing else), so it is read with an unpickler that refuses every class: a pickle that names one is not a
snapshot, and loading it runs nothing. Field names are torch's (``torch.cuda.memory._snapshot``'s docstring,
``torch/cuda/_memory_viz.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from batchfit.devices.allocator_settings import ROUNDUP_INTERVALS
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.errors import InputError

REQUESTS = ("alloc", "oom")
UNLIMITED_BYTES = 1 << 60  # the capacity of a replay that knows none
TOO_LARGE = 1 << 62  # a max_split_size past this is torch's "unlimited" (SIZE_MAX), however it was written


class _NoClasses(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}, which no memory snapshot holds")


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """The snapshot pickled at ``path``; an ``InputError`` naming what is wrong when the file is not a pickle, or
    not a memory snapshot (a dict with ``segments`` and ``device_traces``)."""
    data = Path(path).read_bytes()
    try:
        snapshot = _NoClasses(io.BytesIO(data)).load()
    except Exception as error:  # any malformed pickle: UnpicklingError, EOFError, ValueError, ...
        raise InputError(
            f"{path} is not a memory snapshot: it does not unpickle ({error}); write one with "
            "torch.cuda.memory._dump_snapshot(path) or batchfit find/estimate --memory-snapshot"
        ) from None
    check_snapshot(snapshot, str(path))
    return snapshot


def check_snapshot(snapshot: Any, name: str = "the snapshot") -> None:
    """An ``InputError`` unless ``snapshot`` has the shape torch gives a memory snapshot."""
    problem = _shape_problem(snapshot)
    if problem:
        raise InputError(f"{name} is not a memory snapshot: {problem}")


def _shape_problem(snapshot: Any) -> str | None:
    if not isinstance(snapshot, dict):
        return f"it holds a {type(snapshot).__name__}, not the dict torch.cuda.memory._snapshot() returns"
    missing = [key for key in ("segments", "device_traces") if key not in snapshot]
    if missing:
        return f"it has no {' and no '.join(missing)}"
    if not isinstance(snapshot["segments"], list) or not isinstance(snapshot["device_traces"], list):
        return "its segments and device_traces are not lists"
    for segment in snapshot["segments"]:
        if not isinstance(segment, dict) or not {"address", "total_size", "blocks"} <= segment.keys():
            return "a segment lacks its address, total_size or blocks"
    for trace in snapshot["device_traces"]:
        if not isinstance(trace, list) or any(not isinstance(e, dict) or "action" not in e for e in trace):
            return "a device trace is not a list of events with an action"
    return None


# -- what the snapshot says ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceEvent:
    """One event of a device trace: its position there, its action, address and size (``oom``: ``device_free``)."""

    index: int
    action: str
    addr: int
    size: int
    device_free: int | None = None

    def key(self) -> tuple[str, int, int]:
        return (self.action, 0 if self.action == "oom" else self.addr, self.size)

    def describe(self) -> str:
        from batchfit.devices.units import format_bytes

        if self.action == "oom":
            return f"oom for {format_bytes(self.size)}"
        return f"{self.action} of {format_bytes(self.size)} at {self.addr:#x}"


@dataclass(frozen=True)
class Range:
    """A segment, or a run of mapped pages of an expandable one: where it starts, its size, its pool."""

    addr: int
    size: int
    small: bool
    expandable: bool = False

    @property
    def end(self) -> int:
        return self.addr + self.size


@dataclass
class Held:
    """A block handed out when the trace began: its address, the size requested, its size where known."""

    addr: int
    requested: int
    size: int | None = None


@dataclass
class SnapshotStart:
    """The allocator's state when the trace began (see the module's docstring)."""

    segments: list[Range] = field(default_factory=list)  # whole segments (not expandable)
    mapped: list[Range] = field(default_factory=list)  # runs of mapped pages of expandable segments
    held: list[Held] = field(default_factory=list)
    seen: dict[bool, list[tuple[int, int]]] = field(default_factory=dict)  # pool.small -> every range ever mapped


@dataclass(frozen=True)
class Snapshot:
    """A snapshot read for a replay: one device's trace, the settings and capacity it ran with (and where each was
    read), the state when its trace began, and batchfit's own notes where batchfit wrote it."""

    device: int
    events: tuple[TraceEvent, ...]
    settings: AllocatorSettings
    settings_source: str
    capacity_bytes: int | None
    capacity_source: str
    start: SnapshotStart
    about: dict[str, Any]
    unmodelled: tuple[str, ...] = ()  # what the snapshot holds that the replay reads as one stream, default pools

    @property
    def replay_capacity(self) -> int:
        return self.capacity_bytes if self.capacity_bytes is not None else UNLIMITED_BYTES


def unmodelled_parts(trace: list[dict[str, Any]], segments: list[dict[str, Any]]) -> tuple[str, ...]:
    """What the replay does not model that the snapshot shows: several streams, private pools (CUDA graphs)."""
    streams = {entry.get("stream", 0) for entry in trace} | {segment.get("stream", 0) for segment in segments}
    pools = {tuple(s.get("segment_pool_id") or (0, 0)) for s in segments} - {(0, 0)}
    found = []
    if len(streams) > 1:
        found.append(f"{len(streams)} streams (replayed as one)")
    if pools:
        found.append(f"private pools ({len(pools)}), such as CUDA graphs' (replayed as the default pools)")
    return tuple(found)


def trace_events(trace: list[dict[str, Any]]) -> list[TraceEvent]:
    events = []
    for index, entry in enumerate(trace):
        try:
            action = str(entry["action"])
            addr = int(entry.get("addr", 0) or 0)
            size = int(entry.get("size", 0) or 0)
            free = entry.get("device_free")
            events.append(TraceEvent(index, action, addr, size, None if free is None else int(free)))
        except (TypeError, ValueError):
            raise InputError(f"the snapshot is not a memory snapshot: its trace event {index} is malformed") from None
    return events


def snapshot_settings(snapshot: dict[str, Any]) -> tuple[AllocatorSettings, str]:
    """The allocator settings a snapshot names, and where they were read: its ``allocator_settings`` (torch 2.4
    on: the ``PYTORCH_CUDA_ALLOC_CONF`` string, then the values torch read from it, which win), else torch's
    defaults."""
    entry = snapshot.get("allocator_settings")
    if not isinstance(entry, dict) or not entry:
        return AllocatorSettings(), "torch's defaults (the snapshot names no allocator_settings)"
    settings = AllocatorSettings()
    text = entry.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(text, str) and text:
        with contextlib.suppress(InputError):  # a string batchfit cannot read: the values below say what torch did
            settings = AllocatorSettings.parse(text)
    values: dict[str, Any] = {}
    if isinstance(entry.get("expandable_segments"), bool):
        values["expandable_segments"] = entry["expandable_segments"]
    limit = entry.get("max_split_size")
    if isinstance(limit, int) and not isinstance(limit, bool):
        values["max_split_size_bytes"] = limit if 0 < limit < TOO_LARGE else None
    threshold = entry.get("garbage_collection_threshold")
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and 0 <= threshold < 1:
        values["garbage_collection_threshold"] = float(threshold)
    divisions = entry.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and divisions:
        ordered = sorted(((int(k), int(v)) for k, v in divisions.items() if str(k).isdigit()), key=lambda kv: kv[0])
        slots = [d for _, d in ordered][:ROUNDUP_INTERVALS]
        values["roundup_divisions"] = tuple(slots + [0] * (ROUNDUP_INTERVALS - len(slots)))
    settings = dataclasses.replace(settings, **values)
    return settings, "the snapshot's allocator_settings"


def snapshot_capacity(
    given: int | None, about: dict[str, Any], start: SnapshotStart, events: tuple[TraceEvent, ...]
) -> tuple[int | None, str]:
    if given is not None:
        return given, "given"
    noted = about.get("capacity_bytes")
    if isinstance(noted, int) and noted > 0:
        return noted, "batchfit's note in the snapshot"
    reserved = start_reserved_bytes(start)
    for event in events:
        if event.action == "oom" and event.device_free is not None:
            return reserved + event.device_free, f"the first oom (event {event.index}): reserved then + device_free"
        reserved += reserve_delta(event)
    return None, "unknown (the snapshot has no oom event: give --capacity)"


def reserve_delta(event: TraceEvent) -> int:
    """What ``event`` changes the reserved bytes by."""
    if event.action in ("segment_alloc", "segment_map"):
        return event.size
    if event.action in ("segment_free", "segment_unmap"):
        return -event.size
    return 0


def start_reserved_bytes(start: SnapshotStart) -> int:
    return sum(r.size for r in start.segments) + sum(r.size for r in start.mapped)


# -- the walk back -------------------------------------------------------------------------------------------------


__all__ = [
    "Held",
    "Range",
    "Snapshot",
    "SnapshotStart",
    "TraceEvent",
    "check_snapshot",
    "load_snapshot",
    "reserve_delta",
    "snapshot_settings",
    "start_reserved_bytes",
]
