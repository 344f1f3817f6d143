"""The pieces of the caching allocator model: ``Block`` (a piece of a segment), ``Pool`` (the free blocks of one
pool and the unmapped ranges of its expandable segment) and ``AllocatorStats``. Both halves of the allocator use
them: ``batchfit.devices.caching_allocator`` and its expandable segments, ``batchfit.devices.expandable``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from batchfit.devices.allocator_settings import MIB

SMALL_BUFFER_BYTES = 2 * MIB  # kSmallBuffer: a small-pool segment, and a page of the small expandable segment


class Block:
    """A piece of a segment: free or allocated, with its neighbours in the segment (``prev``, ``next``)."""

    __slots__ = ("allocated", "expandable", "gc_base", "mapped", "next", "pool", "prev", "ptr", "size")

    def __init__(self, pool: Pool, ptr: int, size: int, *, mapped: bool = True, expandable: bool = False):
        self.pool = pool
        self.ptr = ptr
        self.size = size
        self.allocated = False
        self.mapped = mapped
        self.expandable = expandable
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_base = 0

    def copy_to(self, pool: Pool) -> Block:
        """A copy of this block in ``pool``, unlinked (``CachingAllocator.copy`` links the copies)."""
        twin = Block(pool, self.ptr, self.size, mapped=self.mapped, expandable=self.expandable)
        twin.allocated, twin.gc_base = self.allocated, self.gc_base
        return twin

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        """Link this block between ``before`` and ``after``."""
        self.prev, self.next = before, after
        if before is not None:
            before.next = self
        if after is not None:
            after.prev = self


class Pool:
    """The free blocks of one pool, ordered by (size, address) as torch's ``BlockComparatorSize``; the unmapped
    ranges of its expandable segment; and its count of cache lookups (the garbage collector's clock)."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[int, Block] = {}  # address -> free block
        self.unmapped: dict[int, Block] = {}  # address -> unmapped range (expandable segments)
        self.lookups = 0

    def insert(self, block: Block) -> None:
        bisect.insort(self.keys, (block.size, block.ptr))
        self.blocks[block.ptr] = block
        block.gc_base = self.lookups  # insert_into_blocks: the block's age starts now

    def erase(self, block: Block) -> None:
        index = bisect.bisect_left(self.keys, (block.size, block.ptr))
        del self.keys[index]
        del self.blocks[block.ptr]

    def remove(self, block: Block) -> None:
        """Take ``block`` out of whichever set holds it (free or unmapped)."""
        if block.mapped:
            self.erase(block)
        else:
            del self.unmapped[block.ptr]

    def at_least(self, size: int) -> int:
        """The index in ``keys`` of the smallest free block of ``size`` bytes or more."""
        return bisect.bisect_left(self.keys, (size, -1))


@dataclass
class AllocatorStats:
    """What ``torch.cuda.memory_stats`` reports, for the aggregate of both pools."""

    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    num_alloc_retries: int = 0
    num_ooms: int = 0
    num_device_alloc: int = 0
    num_device_free: int = 0
