"""The caching allocator model, reporting what it does as torch's allocator reports it in a memory snapshot's
device trace: every request served (``alloc``) or refused (``oom``), every block freed (``free_completed``), every
segment taken from the driver or given back (``segment_alloc``, ``segment_free``) and, with expandable segments,
every range of pages mapped or unmapped (``segment_map``, ``segment_unmap``).

``RecordingAllocator`` is a ``CachingAllocator`` that appends an ``AllocatorEvent`` for each, with the reserved and
allocated bytes after it; nothing it decides changes (each method calls the model's own and only writes down what
happened). What each event's ``addr`` and ``size`` hold follows torch's ``record_trace`` calls
(``c10/core/CachingDeviceAllocator.h``, torch 2.13): ``alloc`` the block's address and the size requested (not the
rounded one); ``free_completed`` the address and the size that was requested; ``segment_alloc`` and ``segment_free``
the segment's address and size; ``segment_map`` and ``segment_unmap`` the range of pages; ``oom`` the request's
rounded size, and in ``device_free`` what the device could still give.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.devices.allocator_blocks import Block
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.caching_allocator import round_size
from batchfit.devices.expandable import Expandable

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
RELEASES = ("segment_free", "segment_unmap")


@dataclass(frozen=True)
class AllocatorEvent:
    """One thing the allocator did, with its reserved and allocated bytes right after it.

    >>> AllocatorEvent("segment_alloc", 0, 2 * 2**20, reserved_bytes=2 * 2**20).describe()
    'segment_alloc of 2.0 MiB at 0x0'
    """

    action: str
    addr: int
    size: int
    reserved_bytes: int = 0
    allocated_bytes: int = 0
    device_free: int | None = None  # oom only: what the device could still give

    def key(self) -> tuple[str, int, int]:
        """What two traces must agree on: the action, the address (none for ``oom``) and the size."""
        return (self.action, 0 if self.action == "oom" else self.addr, self.size)

    def describe(self) -> str:
        from batchfit.devices.units import format_bytes

        if self.action == "oom":
            return f"oom for {format_bytes(self.size)}"
        return f"{self.action} of {format_bytes(self.size)} at {self.addr:#x}"


class RecordingAllocator(CachingAllocator):
    """A ``CachingAllocator`` that writes down, in ``events``, what it does (see the module's docstring), and in
    ``requested`` the size each handed-out block was requested at. It serves every request as the model does.

    >>> allocator = RecordingAllocator(64 * 2**20)
    >>> allocator.free(allocator.malloc(3 * 2**20))
    >>> [(e.action, e.size // 2**20) for e in allocator.events]
    [('segment_alloc', 20), ('alloc', 3), ('free_completed', 3)]
    """

    events: list[AllocatorEvent]
    requested: dict[int, int]

    def __init__(self, capacity_bytes: int, settings: AllocatorSettings | None = None):
        super().__init__(capacity_bytes, settings)
        self._start_recording()

    @classmethod
    def of(cls, allocator: CachingAllocator) -> RecordingAllocator:
        """A recording allocator in ``allocator``'s state (a copy: ``allocator`` is left as it is); the sizes its
        handed-out blocks were requested at are not known, and read as the blocks' sizes."""
        copied = allocator.copy()
        recording = cls.__new__(cls)
        recording.__dict__.update(copied.__dict__)
        recording._start_recording()
        return recording

    def _start_recording(self) -> None:
        self.events = []
        self.requested = {}
        if self.expandable is not None:
            twin = RecordingExpandable(self)
            twin.bases = dict(self.expandable.bases)
            self.expandable = twin

    def note(self, action: str, addr: int, size: int, device_free: int | None = None) -> None:
        stats = self.stats
        self.events.append(AllocatorEvent(action, addr, size, stats.reserved_bytes, stats.allocated_bytes, device_free))

    def requested_size(self, block: Block) -> int:
        """The size ``block`` was requested at (its own size where it was handed out before recording began)."""
        return self.requested.get(id(block), block.size)

    # -- what the model does, written down -----------------------------------------------------------------

    def malloc(self, nbytes: int) -> Block | None:
        block = super().malloc(nbytes)
        if block is None:
            self.note("oom", 0, round_size(nbytes, self.settings), device_free=self.free_bytes())
        else:
            self.requested[id(block)] = nbytes
            self.note("alloc", block.ptr, nbytes)
        return block

    def free(self, block: Block) -> None:
        ptr, size = block.ptr, self.requested.pop(id(block), block.size)
        super().free(block)
        self.note("free_completed", ptr, size)

    def _new_block(self, pool, size: int, segment_bytes: int) -> Block | None:
        block = super()._new_block(pool, size, segment_bytes)
        if block is not None and self.expandable is None:
            self.note("segment_alloc", block.ptr, block.size)
        return block

    def _release(self, block: Block) -> None:
        ptr, size = block.ptr, block.size
        super()._release(block)
        self.note("segment_free", ptr, size)


class RecordingExpandable(Expandable):
    """The expandable half of a ``RecordingAllocator``: each range of pages mapped or unmapped, written down."""

    allocator: RecordingAllocator

    def _map(self, block: Block, nbytes: int) -> bool:
        page = self.page_bytes(block.pool)
        ptr, mapped = block.ptr, min(-(-nbytes // page) * page, block.size)  # as Expandable._map maps them
        done = super()._map(block, nbytes)
        if done:
            self.allocator.note("segment_map", ptr, mapped)
        return done

    def unmap(self, block: Block) -> None:
        page = self.page_bytes(block.pool)
        base = self.bases[block.pool.small]
        begin = base + -(-(block.ptr - base) // page) * page  # the first whole page, as Expandable.unmap finds it
        before = self.allocator.stats.reserved_bytes
        super().unmap(block)
        released = before - self.allocator.stats.reserved_bytes
        if released:
            self.allocator.note("segment_unmap", begin, released)
