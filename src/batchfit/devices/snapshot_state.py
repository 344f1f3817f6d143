"""Rebuild the caching allocator's state when a memory snapshot's trace began (the snapshot read by
``batchfit.devices.snapshot_files``), for ``batchfit.devices.snapshot_replay``.

The file is a pickle of builtins only (dicts, lists, strings, numbers: ``torch/csrc/cuda/memory_snapshot.cpp``
writes nothing else), so it is read with an unpickler that refuses every class: a pickle that names one is not a
snapshot, and loading it runs nothing. Field names are torch's (``torch.cuda.memory._snapshot``'s docstring,
``torch/cuda/_memory_viz.py``).

A snapshot holds the allocator's segments when it was taken and the events since recording began; the state when
recording began is walked back from the end, as torch's viewer walks it (``MemoryViz.js``, ``simulate_memory``):
a segment the trace allocated did not exist before it, one it freed did; a block it allocated was not held
before, one it freed was. What the walk cannot see is inferred: a block held before the trace and freed in it is
known only by the size it was requested at, so its size is that request rounded as the allocator rounds it, and
all the room up to the next block where the allocator would not have split that room off (``should_split``).
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from batchfit.devices.allocator_blocks import SMALL_BUFFER_BYTES
from batchfit.devices.allocator_blocks import Block
from batchfit.devices.allocator_events import RecordingAllocator
from batchfit.devices.allocator_settings import LARGE_SEGMENT_BYTES
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.caching_allocator import MIN_BLOCK_BYTES
from batchfit.devices.caching_allocator import SMALL_SIZE_BYTES
from batchfit.devices.caching_allocator import round_size
from batchfit.devices.expandable import ADDRESS_SPACE_FACTOR
from batchfit.devices.snapshot_files import Held
from batchfit.devices.snapshot_files import Range
from batchfit.devices.snapshot_files import Snapshot
from batchfit.devices.snapshot_files import SnapshotStart
from batchfit.devices.snapshot_files import TraceEvent
from batchfit.devices.snapshot_files import check_snapshot
from batchfit.devices.snapshot_files import snapshot_capacity
from batchfit.devices.snapshot_files import snapshot_settings
from batchfit.devices.snapshot_files import trace_events
from batchfit.devices.snapshot_files import unmodelled_parts
from batchfit.errors import InputError


def read_snapshot(
    snapshot: dict[str, Any],
    *,
    settings: AllocatorSettings | None = None,
    capacity_bytes: int | None = None,
    device: int | None = None,
) -> Snapshot:
    """``snapshot`` (a dict, as ``load_snapshot`` returns it) read for a replay: the device whose trace has the most
    events (or ``device``), the settings it names (or ``settings``), its capacity (``capacity_bytes``, else
    batchfit's note of it, else the first ``oom``: the bytes reserved then and ``device_free``; else unknown)."""
    check_snapshot(snapshot)
    traces = snapshot["device_traces"]
    if device is None:
        device = max(range(len(traces)), key=lambda i: len(traces[i]), default=0)
    if not 0 <= device < max(len(traces), 1):
        raise InputError(f"the snapshot has no device {device}: it traces {len(traces)}")
    events = tuple(trace_events(traces[device] if traces else []))
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    if settings is not None:
        chosen, settings_source = settings, "given"
    else:
        chosen, settings_source = snapshot_settings(snapshot)
    about = snapshot.get("batchfit") if isinstance(snapshot.get("batchfit"), dict) else {}
    start = _walk_back(segments, events)
    capacity, capacity_source = snapshot_capacity(capacity_bytes, about, start, events)
    unmodelled = unmodelled_parts(traces[device] if traces else [], segments)
    return Snapshot(device, events, chosen, settings_source, capacity, capacity_source, start, about, unmodelled)


def _walk_back(segments: list[dict[str, Any]], events: tuple[TraceEvent, ...]) -> SnapshotStart:
    """The state when the trace began, from the segments at its end and its events walked backwards."""
    whole: dict[int, Range] = {}
    mapped: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    held: dict[int, Held] = {}
    for segment in segments:
        small = segment.get("segment_type") == "small"
        address, size = int(segment["address"]), int(segment["total_size"])
        if segment.get("is_expandable"):
            _add(mapped[small], address, address + size)
        else:
            whole[address] = Range(address, size, small)
        for block in segment["blocks"]:
            if str(block.get("state", "")).startswith("active"):
                addr = int(block.get("address", address))
                held[addr] = Held(addr, int(block.get("requested_size") or block["size"]), int(block["size"]))
            address = int(block.get("address", address)) + int(block["size"])
    pools = _expandable_pools(mapped, events)
    seen = {small: list(ranges) for small, ranges in mapped.items()}
    for event in reversed(events):
        action = event.action
        if action == "alloc":
            held.pop(event.addr, None)
        elif action == "free_completed":
            held[event.addr] = Held(event.addr, event.size)
        elif action == "segment_alloc":
            whole.pop(event.addr, None)
        elif action == "segment_free":
            whole[event.addr] = Range(event.addr, event.size, small=event.size == SMALL_BUFFER_BYTES)
        elif action in ("segment_map", "segment_unmap"):
            small = pools[event.index]
            _add(seen[small], event.addr, event.addr + event.size)
            (_remove if action == "segment_map" else _add)(mapped[small], event.addr, event.addr + event.size)
    start = SnapshotStart(segments=sorted(whole.values(), key=lambda r: r.addr))
    for small, ranges in mapped.items():
        start.mapped += [Range(a, b - a, small, expandable=True) for a, b in ranges]
    start.seen = seen
    start.mapped.sort(key=lambda r: r.addr)
    start.held = sorted(held.values(), key=lambda h: h.addr)
    return start


def _expandable_pools(mapped: dict[bool, list[tuple[int, int]]], events: tuple[TraceEvent, ...]) -> dict[int, bool]:
    """Which pool each map and unmap of the trace is in (``True``: small). A range that is not whole large pages
    (20 MiB) is the small pool's; the rest belong to the pool whose known pages lie nearest."""
    anchors: dict[bool, list[int]] = {small: [a for a, _ in ranges] for small, ranges in mapped.items()}
    ambiguous = []
    pools: dict[int, bool] = {}
    for event in events:
        if event.action in ("segment_map", "segment_unmap"):
            if event.size % LARGE_SEGMENT_BYTES:
                pools[event.index] = True
                anchors[True].append(event.addr)
            else:
                ambiguous.append(event)
    for event in ambiguous:
        distance = {
            small: min((abs(event.addr - a) for a in anchors[small]), default=math.inf) for small in (True, False)
        }
        pools[event.index] = distance[True] < distance[False]
    return pools


def _add(ranges: list[tuple[int, int]], begin: int, end: int) -> None:
    """``[begin, end)`` joined to ``ranges`` (sorted, disjoint, touching ranges merged)."""
    kept = [(a, b) for a, b in ranges if b < begin or a > end]
    for a, b in ranges:
        if not (b < begin or a > end):
            begin, end = min(begin, a), max(end, b)
    bisect.insort(kept, (begin, end))
    ranges[:] = kept


def _remove(ranges: list[tuple[int, int]], begin: int, end: int) -> None:
    kept = []
    for a, b in ranges:
        if b <= begin or a >= end:
            kept.append((a, b))
            continue
        if a < begin:
            kept.append((a, begin))
        if b > end:
            kept.append((end, b))
    ranges[:] = kept


# -- the allocator in that state -----------------------------------------------------------------------------------


class ReplayAllocator(RecordingAllocator):
    """A ``RecordingAllocator`` whose new segments take the addresses the card gave them, where it is told them
    (``planned``: the trace's segment events about to be matched), so blocks sit and tie where the card's did."""

    planned: list[tuple[int, int]]  # (address, size) of the segments the card allocated, in order
    planned_bases: list[int]  # where the card began mapping a pool's expandable segment

    def plan(self, segments: list[tuple[int, int]], bases: list[int]) -> None:
        self.planned, self.planned_bases = list(segments), list(bases)

    def _address(self, nbytes: int) -> int:
        if self.expandable is not None and getattr(self, "planned_bases", None):
            return self.planned_bases.pop(0)
        planned = getattr(self, "planned", None)
        if self.expandable is None and planned and planned[0][1] == nbytes:
            return planned.pop(0)[0]
        return super()._address(nbytes)


def start_allocator(
    snap: Snapshot, settings: AllocatorSettings | None = None
) -> tuple[ReplayAllocator, dict[int, Block]]:
    """A ``ReplayAllocator`` in the state the snapshot's trace began in (``snap.settings``; with other
    ``settings``, the blocks held then requested again in address order, as a process with those settings would
    hold them) and the blocks held then, by address."""
    allocator = ReplayAllocator(snap.replay_capacity, snap.settings)
    held = _build(allocator, snap)
    if settings is None or settings == snap.settings:
        allocator.events.clear()
        return allocator, held
    twin = ReplayAllocator(snap.replay_capacity, settings)
    twin._next_address = allocator._next_address
    rebuilt = {}
    for addr, block in sorted(held.items()):
        again = twin.malloc(block.size)
        if again is not None:
            twin.requested[id(again)] = allocator.requested_size(block)
            rebuilt[addr] = again
    twin.events.clear()
    twin.reset_peak()
    return twin, rebuilt


def _build(allocator: ReplayAllocator, snap: Snapshot) -> dict[int, Block]:
    start, settings = snap.start, snap.settings
    held = {h.addr: h for h in start.held}
    blocks: dict[int, Block] = {}
    highest = max([r.end for r in (*start.segments, *start.mapped)] + [e.addr + e.size for e in snap.events] + [0])
    for segment in start.segments:
        pool = allocator.small if segment.small else allocator.large
        pieces = _pieces(segment, held, settings)
        _link(allocator, pool, pieces, blocks, expandable=False)
        allocator.stats.reserved_bytes += segment.size
    for small in (True, False):
        pool = allocator.small if small else allocator.large
        page = SMALL_BUFFER_BYTES if small else LARGE_SEGMENT_BYTES
        reach = -(-int(ADDRESS_SPACE_FACTOR * allocator.capacity_bytes) // page) * page
        runs = [r for r in start.mapped if r.small == small]
        for base, end in expandable_segments(start.seen.get(small, []), reach):
            inside = [r for r in runs if base <= r.addr < end]
            if not inside:
                continue  # no page mapped when the trace began: made when the replay first needs it
            pieces: list[tuple[int, int, bool, bool]] = []  # (addr, size, held, mapped)
            cursor = base
            for run in inside:
                if run.addr > cursor:
                    pieces.append((cursor, run.addr - cursor, False, False))
                pieces += [(a, size, h, True) for a, size, h in _pieces(run, held, settings)]
                allocator.stats.reserved_bytes += run.size
                cursor = run.end
            if cursor < end:
                pieces.append((cursor, end - cursor, False, False))
            _link(allocator, pool, pieces, blocks, expandable=True)
            allocator.expandable.bases[small] = base  # the model aligns pages to its newest segment's base
            highest = max(highest, end)
    for addr, block in blocks.items():
        allocator.requested[id(block)] = held[addr].requested
    allocator.stats.allocated_bytes = sum(b.size for b in allocator.active)
    allocator.reset_peak()
    allocator._next_address = -(-(highest + LARGE_SEGMENT_BYTES) // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES
    return blocks


def expandable_segments(ranges: list[tuple[int, int]], reach: int) -> list[tuple[int, int]]:
    """The expandable segments of one pool, as (base, end), from every range of pages it ever mapped: each
    reserves ``reach`` bytes of addresses from its lowest page seen (1.125 times the device's memory, as
    ``Expandable`` and torch's ``ExpandableSegment`` reserve), and the next begins past it.

    >>> expandable_segments([(0, 20), (40, 60), (200, 220)], reach=100)
    [(0, 100), (200, 300)]
    """
    segments: list[tuple[int, int]] = []
    for begin, end in sorted(ranges):
        if segments and begin < segments[-1][1]:
            segments[-1] = (segments[-1][0], max(segments[-1][1], end))
        else:
            segments.append((begin, max(begin + reach, end)))
    return segments


def _pieces(run: Range, held: dict[int, Held], settings: AllocatorSettings) -> list[tuple[int, int, bool]]:
    """The blocks of a segment (or a mapped run) when the trace began: (address, size, held) in address order,
    the free room between held blocks one free block each (free neighbours always merge)."""
    inside = sorted(a for a in held if run.addr <= a < run.end)
    pieces = []
    cursor = run.addr
    for i, addr in enumerate(inside):
        if addr < cursor:
            continue  # overlaps the block before: the walk back could not place it
        limit = inside[i + 1] if i + 1 < len(inside) else run.end
        size = held[addr].size or _inferred_size(held[addr].requested, limit - addr, run, settings)
        size = min(size, run.end - addr)
        if addr > cursor:
            pieces.append((cursor, addr - cursor, False))
        pieces.append((addr, size, True))
        cursor = addr + size
    if cursor < run.end:
        pieces.append((cursor, run.end - cursor, False))
    return pieces


def _inferred_size(requested: int, room: int, run: Range, settings: AllocatorSettings) -> int:
    """The size of a block known only by its request: rounded as ``round_size`` rounds it, and with the ``room``
    after it (to the next held block or the segment's end) where ``should_split`` would not have split it off."""
    size = round_size(requested, settings)
    remaining = room - size
    if remaining <= 0:
        return room
    if run.small or run.expandable:
        split = remaining >= MIN_BLOCK_BYTES
    else:
        limit = settings.max_split_size_bytes
        split = (limit is None or size < limit) and remaining > SMALL_SIZE_BYTES
    return size if split else room


def _link(
    allocator: ReplayAllocator,
    pool: Any,
    pieces: list[tuple],
    blocks: dict[int, Block],
    *,
    expandable: bool,
) -> None:
    """One segment's blocks made and linked in address order: held ones handed out, free ones in the pool,
    unmapped ones among the pool's unmapped ranges."""
    before: Block | None = None
    for piece in pieces:
        addr, size, is_held = piece[:3]
        mapped = piece[3] if len(piece) > 3 else True
        block = Block(pool, addr, size, mapped=mapped, expandable=expandable)
        block.splice(before, None)
        if is_held:
            block.allocated = True
            allocator.active.add(block)
            blocks[addr] = block
        elif mapped:
            pool.insert(block)
        else:
            pool.unmapped[addr] = block
        before = block


def expandable_base_candidates(allocator: ReplayAllocator, group: list[TraceEvent]) -> list[int]:
    """Where the maps of ``group`` begin a new expandable segment: at an address no expandable segment of the
    allocator covers yet (the model asks for one only when it starts a segment)."""
    covered, heads = [], set()
    blocks = [*allocator.active]
    for pool in (allocator.small, allocator.large):
        blocks += [*pool.blocks.values(), *pool.unmapped.values()]
    for block in blocks:
        if not block.expandable:
            continue
        head = block
        while head.prev is not None:
            head = head.prev
        if id(head) in heads:
            continue
        heads.add(id(head))
        tail = head
        while tail.next is not None:
            tail = tail.next
        covered.append((head.ptr, tail.ptr + tail.size))
    return [e.addr for e in group if e.action == "segment_map" and not any(a <= e.addr < b for a, b in covered)]


__all__ = [
    "ReplayAllocator",
    "read_snapshot",
    "start_allocator",
]
