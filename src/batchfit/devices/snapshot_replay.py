"""Replay a PyTorch memory snapshot through the caching allocator model, and compare what the model does with what
the card did, event by event.

The snapshot (``torch.cuda.memory._dump_snapshot``, or batchfit's own: ``batchfit.devices.memory_snapshots``) is read
and its allocator's state when recording began rebuilt (``batchfit.devices.snapshot_state``). Then its requests and
frees run, in order, through a ``CachingAllocator`` with the settings the snapshot names:

- a request is an ``alloc`` event (of the size requested) or an ``oom`` (of the size torch rounded it to);
- a free is a ``free_completed`` event, not ``free_requested``: torch's ``free`` records ``free_requested`` and,
  where no other stream still uses the block (``record_stream``), returns the block to its pool at once and records
  ``free_completed``; on another stream it waits for the block's events. The model's ``free`` is that return to the
  pool (``free_block``), so ``free_completed`` is when it happens;
- the card's ``segment_alloc``, ``segment_free``, ``segment_map`` and ``segment_unmap`` events are what the model
  must do on its own: each request's are compared with what the model did serving it (torch records them inside
  ``malloc``, before the ``alloc`` or ``oom``). Releases no request explains (the model would serve the next one
  without them) are ``torch.cuda.empty_cache()``: the model empties its cache there too, and says so.

For each request and free, the model's events (``RecordingAllocator``) must equal the card's: the same action, the
same address (a new segment takes the address the card's ``cudaMalloc`` returned, so blocks sit and tie where the
card's did) and the same size, and the reserved bytes after it must equal the card's (the reserved bytes when the
trace began plus every segment event since). The first difference is reported; the replay goes on driven by the
card's requests, so a later request still frees the block its ``alloc`` made.

Not modelled: streams (every event is read as stream 0's), CUDA graphs and private pools (``segment_pool_id``), the
garbage collector's block ages when the trace began, and an allocator whose settings changed while it recorded.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from dataclasses import field

from batchfit.devices.allocator_blocks import Block
from batchfit.devices.allocator_events import RELEASES
from batchfit.devices.allocator_events import SEGMENT_ACTIONS
from batchfit.devices.allocator_events import AllocatorEvent
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.snapshot_files import REQUESTS
from batchfit.devices.snapshot_files import Snapshot
from batchfit.devices.snapshot_files import TraceEvent
from batchfit.devices.snapshot_files import reserve_delta
from batchfit.devices.snapshot_files import start_reserved_bytes
from batchfit.devices.snapshot_state import ReplayAllocator
from batchfit.devices.snapshot_state import expandable_base_candidates
from batchfit.devices.snapshot_state import start_allocator
from batchfit.devices.units import format_bytes

LARGEST_BATCH_FACTOR = 64  # the largest batch a replay looks for: this many times the batch recorded


@dataclass(frozen=True)
class Mismatch:
    """Where the model first did something else than the card: the trace event (its position, what the card did)
    and what the model did in its place."""

    index: int | None
    card: str
    model: str

    def describe(self) -> str:
        where = f"event {self.index}" if self.index is not None else "the end of the trace"
        return f"at {where} the card did {self.card}; the model did {self.model}"


@dataclass(frozen=True)
class SnapshotReplay:
    """What the replay found: how many of the card's events were compared and how many differed (the first, and
    where the card emptied its cache), the ``oom`` requests of the card and of the model (trace positions), the
    model's peak of reserved bytes with the most it held at that peak, and every event the model made, in order
    (``model_events``, addresses the card's). ``matched``: every event the same."""

    compared: int
    mismatches: int
    first_mismatch: Mismatch | None
    requests: int
    frees: int
    segment_events: int
    empty_caches: tuple[int, ...]
    card_ooms: tuple[int, ...]
    model_ooms: tuple[int, ...]
    peak_reserved_bytes: int
    allocated_at_peak_bytes: int
    peak_index: int | None
    card_peak_reserved_bytes: int
    oom_bytes: tuple[int, int] | None = None  # the model's reserved and allocated bytes at its first oom
    model_events: tuple[AllocatorEvent, ...] = field(default=(), repr=False)  # what the model did, in order

    @property
    def matched(self) -> bool:
        return self.mismatches == 0 and self.card_ooms == self.model_ooms

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not handed out at the peak of reserved bytes: what fragmentation cost there."""
        return self.peak_reserved_bytes - self.allocated_at_peak_bytes


@dataclass
class _Replay:
    snap: Snapshot
    model: ReplayAllocator
    held: dict[int, Block]
    card_reserved: dict[int, int]
    compared: int = 0
    mismatches: int = 0
    first: Mismatch | None = None
    unserved: set[int] = field(default_factory=set)
    empty_caches: list[int] = field(default_factory=list)
    card_ooms: list[int] = field(default_factory=list)
    model_ooms: list[int] = field(default_factory=list)
    peak: tuple[int, int, int | None] = (0, 0, None)  # reserved, allocated, trace position
    oom_bytes: tuple[int, int] | None = None

    def run(self) -> None:
        pending: list[TraceEvent] = []
        for event in self.snap.events:
            if event.action in SEGMENT_ACTIONS:
                pending.append(event)
            elif event.action in REQUESTS:
                self.request(event, pending)
                pending = []
            elif event.action == "free_completed":
                if pending:
                    self.emptied(pending)
                    pending = []
                self.free(event)
        if pending:
            self.emptied(pending)

    # -- each of the card's requests and frees -------------------------------------------------------------------

    def request(self, event: TraceEvent, pending: list[TraceEvent]) -> None:
        emptied = any(p.action in RELEASES for p in pending) and self.explained_by_empty_cache(event, pending)
        mark = len(self.model.events)
        if emptied:
            self.model.empty_cache()
            self.empty_caches.append(pending[0].index)
        block = self.serve(self.model, event, pending)
        self.compare([*pending, event], self.model.events[mark:])
        if event.action == "oom":
            self.card_ooms.append(event.index)
        if block is None:
            self.model_ooms.append(event.index)
            if event.action == "alloc":
                self.unserved.add(event.addr)
        elif event.action == "alloc":
            self.held[event.addr] = block
        else:  # the model served what the card could not: given back unrecorded, as the card never held it
            mark = len(self.model.events)
            self.model.free(block)
            del self.model.events[mark:]

    def serve(self, allocator: ReplayAllocator, event: TraceEvent, pending: list[TraceEvent]) -> Block | None:
        segments = [(p.addr, p.size) for p in pending if p.action == "segment_alloc"]
        maps = [p for p in pending if p.action == "segment_map"]
        allocator.plan(segments, expandable_base_candidates(allocator, maps) if maps else [])
        block = allocator.malloc(event.size)
        allocator.plan([], [])
        return block

    def explained_by_empty_cache(self, event: TraceEvent, pending: list[TraceEvent]) -> bool:
        """Whether the releases before a request were an ``empty_cache`` (the model serves the request, releases
        included, only after emptying its cache first), not the request's own retry."""
        expected = [p.key() for p in (*pending, event)]
        alone = ReplayAllocator.of(self.model)
        self.serve(alone, event, pending)
        if [e.key() for e in alone.events] == expected:
            return False
        emptied = ReplayAllocator.of(self.model)
        emptied.empty_cache()
        self.serve(emptied, event, pending)
        return [e.key() for e in emptied.events] == expected

    def free(self, event: TraceEvent) -> None:
        block = self.held.pop(event.addr, None)
        if block is None:
            if event.addr in self.unserved:
                self.unserved.discard(event.addr)  # the model never held it: nothing to give back
                return
            self.compare([event], [], instead="nothing: it holds no block there")
            return
        mark = len(self.model.events)
        self.model.free(block)
        self.compare([event], self.model.events[mark:])

    def emptied(self, pending: list[TraceEvent]) -> None:
        """Segment events no request explains: the card emptied its cache (``torch.cuda.empty_cache``)."""
        mark = len(self.model.events)
        self.model.empty_cache()
        self.empty_caches.append(pending[0].index)
        self.compare(pending, self.model.events[mark:])

    # -- the comparison --------------------------------------------------------------------------------------

    def compare(self, card: list[TraceEvent], done: list[AllocatorEvent], *, instead: str = "nothing") -> None:
        """The card's events against the model's, in order: action, address and size, and the reserved bytes after
        each; the first difference is kept. The model's peak of reserved bytes moves on with its events."""
        for event in done:
            if event.action == "oom" and self.oom_bytes is None:
                self.oom_bytes = (event.reserved_bytes, event.allocated_bytes)
            peak = (event.reserved_bytes, event.allocated_bytes) > self.peak[:2]  # the fullest moment at the peak
            if event.action in ("alloc", "free_completed", "oom") and peak:
                index = card[-1].index if card else None
                self.peak = (event.reserved_bytes, event.allocated_bytes, index)
        self.compared += len(card)
        for i in range(max(len(card), len(done))):
            theirs = card[i] if i < len(card) else None
            ours = done[i] if i < len(done) else None
            if theirs is not None and ours is not None and theirs.key() == ours.key():
                if self.card_reserved[theirs.index] == ours.reserved_bytes:
                    continue
                mismatch = Mismatch(
                    theirs.index,
                    f"{theirs.describe()}, {format_bytes(self.card_reserved[theirs.index])} reserved after it",
                    f"the same with {format_bytes(ours.reserved_bytes)} reserved",
                )
            else:
                mismatch = Mismatch(
                    theirs.index if theirs is not None else (card[-1].index if card else None),
                    theirs.describe() if theirs is not None else "nothing more",
                    ours.describe() if ours is not None else instead,
                )
            self.mismatches += 1
            if self.first is None:
                self.first = mismatch
            return

    def result(self) -> SnapshotReplay:
        events = self.snap.events
        return SnapshotReplay(
            compared=self.compared,
            mismatches=self.mismatches,
            first_mismatch=self.first,
            requests=sum(e.action in REQUESTS for e in events),
            frees=sum(e.action == "free_completed" for e in events),
            segment_events=sum(e.action in SEGMENT_ACTIONS for e in events),
            empty_caches=tuple(self.empty_caches),
            card_ooms=tuple(self.card_ooms),
            model_ooms=tuple(self.model_ooms),
            peak_reserved_bytes=self.peak[0],
            allocated_at_peak_bytes=self.peak[1],
            peak_index=self.peak[2],
            card_peak_reserved_bytes=max([start_reserved_bytes(self.snap.start), *self.card_reserved.values()]),
            oom_bytes=self.oom_bytes,
            model_events=tuple(self.model.events),
        )


def card_reserved_bytes(snap: Snapshot) -> dict[int, int]:
    """The card's reserved bytes after each event of the trace (by position): those when it began, plus every
    segment allocated or mapped, less every one freed or unmapped since."""
    reserved = start_reserved_bytes(snap.start)
    after = {}
    for event in snap.events:
        reserved += reserve_delta(event)
        after[event.index] = reserved
    return after


def replay_snapshot(snap: Snapshot) -> SnapshotReplay:
    """``snap`` (``read_snapshot``) replayed through the caching allocator model with its settings and capacity,
    compared with the card event by event (see the module's docstring)."""
    model, held = start_allocator(snap)
    replay = _Replay(snap, model, held, card_reserved_bytes(snap))
    replay.peak = (model.stats.reserved_bytes, model.stats.allocated_bytes, None)
    replay.run()
    return replay.result()


# -- other settings, other batch sizes ------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestReplay:
    """The card's requests and frees run through the model with ``settings``: whether every request was served,
    the first that was not (its trace position), and the peak of reserved bytes."""

    settings: AllocatorSettings
    served: bool
    failed_index: int | None
    peak_reserved_bytes: int

    def serves(self, index: int) -> bool:
        """Whether the request at trace position ``index`` (and every one before it) was served."""
        return self.failed_index is None or self.failed_index > index


def replay_requests(
    snap: Snapshot,
    settings: AllocatorSettings | None = None,
    *,
    scale: float = 1.0,
    scaled: Collection[int] = (),
    empty_caches: Collection[int] = (),
) -> RequestReplay:
    """The snapshot's requests and frees (not its segment events: the model decides those) run through the model
    from the state the trace began in, with ``settings`` (default: the snapshot's), until a request fails; the
    requests at the positions in ``scaled`` take ``scale`` times their size (rounded up), and the cache is emptied
    where the card emptied it (``empty_caches``: positions, as ``SnapshotReplay.empty_caches``)."""
    model, held = start_allocator(snap, settings)
    empties = set(empty_caches)
    for event in snap.events:
        if event.index in empties:
            model.empty_cache()
        if event.action in REQUESTS:
            size = math.ceil(event.size * scale) if event.index in scaled else event.size
            block = model.malloc(size)
            if block is None:
                return RequestReplay(model.settings, False, event.index, model.stats.peak_reserved_bytes)
            if event.action == "alloc":
                held[event.addr] = block
        elif event.action == "free_completed" and (block := held.pop(event.addr, None)) is not None:
            model.free(block)
        if len(model.events) > 4096:
            model.events.clear()  # nothing reads them here
    return RequestReplay(model.settings, True, None, model.stats.peak_reserved_bytes)


def batch_requests(snap: Snapshot) -> frozenset[int]:
    """The requests taken to grow with the batch (trace positions): those made and freed within the trace
    (activations, the batch, temporaries) and those that ran out of memory. What was held when it began or is
    still held at its end (parameters, gradients, optimizer state) stays as it is."""
    open_at: dict[int, int] = {}
    scaled = set()
    for event in snap.events:
        if event.action == "alloc":
            open_at[event.addr] = event.index
        elif event.action == "free_completed" and event.addr in open_at:
            scaled.add(open_at.pop(event.addr))
        elif event.action == "oom":
            scaled.add(event.index)
    return frozenset(scaled)


@dataclass(frozen=True)
class LargestBatch:
    """The largest batch whose requests the model serves, the snapshot recorded at ``recorded``, and how many
    replays it took."""

    batch_size: int
    recorded: int
    replays: int
    capped: bool  # the search stopped at LARGEST_BATCH_FACTOR times the batch recorded


def largest_batch(snap: Snapshot, batch_size: int, *, empty_caches: Collection[int] = ()) -> LargestBatch:
    """The largest batch the replay suggests, by one plain rule: the requests ``batch_requests`` names grow in
    proportion to the batch (``batch_size`` is the batch recorded), the rest stay; the largest batch whose requests
    are all served, found by doubling from the batch recorded (or halving below it) and bisecting. 0 where not
    even a batch of 1 is served."""
    scaled = batch_requests(snap)
    replays = 0

    def served(batch: int) -> bool:
        nonlocal replays
        replays += 1
        return replay_requests(snap, scale=batch / batch_size, scaled=scaled, empty_caches=empty_caches).served

    if served(batch_size):
        low, high = batch_size, None
        while high is None:
            if low * 2 > batch_size * LARGEST_BATCH_FACTOR:
                return LargestBatch(low, batch_size, replays, capped=True)
            if served(low * 2):
                low *= 2
            else:
                high = low * 2
    else:
        low, high = 0, batch_size
    while high - low > 1:
        middle = (low + high) // 2
        if served(middle):
            low = middle
        else:
            high = middle
    return LargestBatch(low, batch_size, replays, capped=False)
