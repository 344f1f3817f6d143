"""Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) in the caching allocator model.

Each pool reserves one long range of addresses and maps physical pages into it as it grows: 2 MiB pages in the
small pool (``kSmallBuffer``), 20 MiB in the large one (``kLargeBuffer``). A request no cached block serves maps
pages at the lowest address with enough free or unmapped room after it (usually the end); freeing the cache
unmaps every whole free page, also in the middle of the segment. So a large request fails only when the pages it
needs are not there, never for want of a contiguous hole. Rules from torch's ``CachingDeviceAllocator.h``
(``find_expandable_block``, ``try_allocate_expandable_block``, ``map_block``, ``unmap_block``; torch 2.13).
"""

from __future__ import annotations

from typing import Protocol

from batchfit.devices.allocator_blocks import SMALL_BUFFER_BYTES
from batchfit.devices.allocator_blocks import AllocatorStats
from batchfit.devices.allocator_blocks import Block
from batchfit.devices.allocator_blocks import Pool
from batchfit.devices.allocator_settings import LARGE_SEGMENT_BYTES

ADDRESS_SPACE_FACTOR = 1.125  # each segment reserves addresses for 1.125 x the device's memory


class Owner(Protocol):
    """What ``Expandable`` uses of the ``CachingAllocator`` it is half of (which imports this module)."""

    capacity_bytes: int
    stats: AllocatorStats

    def free_bytes(self) -> int: ...
    def _reserve(self, nbytes: int) -> None: ...
    def _address(self, nbytes: int) -> int: ...
    def _merge(self, block: Block, other: Block | None) -> int: ...


def _expandable_size(block: Block) -> int:
    """What a free block can grow to: itself and the unmapped range right after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


class Expandable:
    """The expandable half of one ``CachingAllocator``: a segment per pool, its page size and base address."""

    def __init__(self, allocator: Owner):
        self.allocator = allocator
        self.bases: dict[bool, int] = {}  # pool.small -> the segment's first address

    def page_bytes(self, pool: Pool) -> int:
        return SMALL_BUFFER_BYTES if pool.small else LARGE_SEGMENT_BYTES

    def copy_to(self, allocator: Owner) -> Expandable:
        twin = Expandable(allocator)
        twin.bases = dict(self.bases)
        return twin

    def best_index(self, pool: Pool, index: int) -> int:
        """``get_free_block``'s best fit by expandable size: from the smallest block large enough, move on while
        the next larger block could grow to less (a block before unmapped pages counts them)."""
        keys, blocks = pool.keys, pool.blocks
        while index + 1 < len(keys):
            here, after = blocks[keys[index][1]], blocks[keys[index + 1][1]]
            if _expandable_size(after) >= _expandable_size(here):
                break
            index += 1
        return index

    def grow(self, pool: Pool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: a free block of at least ``size``, made by mapping pages, taken
        out of the pool; ``None`` when the pages cannot be mapped within the capacity."""
        candidate = self._room(pool, size)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            after = candidate.next  # unmapped: mapping it merges the candidate into it
            if not self._map(after, min(size - candidate.size, after.size)):
                return None
            candidate = after
        pool.erase(candidate)
        return candidate

    def unmap(self, block: Block) -> None:
        """``unmap_block``: the whole pages inside free ``block`` go back to the driver; the partial pages at
        either end stay mapped, as free blocks."""
        pool, page = block.pool, self.page_bytes(block.pool)
        base = self.bases[pool.small]
        begin = base + -(-(block.ptr - base) // page) * page
        end = base + (block.ptr + block.size - base) // page * page
        if end <= begin:
            return
        pool.erase(block)
        if begin > block.ptr:
            before = Block(pool, block.ptr, begin - block.ptr, expandable=True)
            before.splice(block.prev, block)
            pool.insert(before)
        if block.ptr + block.size > end:
            after = Block(pool, end, block.ptr + block.size - end, expandable=True)
            after.splice(block, block.next)
            pool.insert(after)
        block.ptr, block.size, block.mapped = begin, end - begin, False
        for neighbour in (block.prev, block.next):
            self.allocator._merge(block, neighbour)
        pool.unmapped[block.ptr] = block
        self.allocator._reserve(-(end - begin))
        self.allocator.stats.num_device_free += 1

    def _room(self, pool: Pool, size: int) -> Block:
        """``find_expandable_block``: the lowest address where free and unmapped blocks in a row give ``size``
        bytes (a free block just before an unmapped range starts there); a new segment when there is none."""
        for unmapped in sorted(pool.unmapped.values(), key=lambda b: b.ptr):
            start = unmapped.prev if unmapped.prev is not None and not unmapped.prev.allocated else unmapped
            room, walk = 0, start
            while room < size and walk is not None and not walk.allocated:
                room, walk = room + walk.size, walk.next
            if room >= size:
                return start
        return self._new_segment(pool)

    def _new_segment(self, pool: Pool) -> Block:
        page = self.page_bytes(pool)
        pages = -(-int(ADDRESS_SPACE_FACTOR * self.allocator.capacity_bytes) // page)
        head = Block(pool, self.allocator._address(pages * page), pages * page, mapped=False, expandable=True)
        self.bases[pool.small] = head.ptr
        pool.unmapped[head.ptr] = head
        return head

    def _map(self, block: Block, nbytes: int) -> bool:
        """``map_block``: map the pages covering the first ``nbytes`` of unmapped ``block``; the rest stays
        unmapped; the mapped block merges with free neighbours and joins the pool. ``False`` past the capacity."""
        page = self.page_bytes(block.pool)
        mapped = min(-(-nbytes // page) * page, block.size)
        if mapped > self.allocator.free_bytes():
            return False  # cuMemCreate fails: nothing is mapped
        pool = block.pool
        del pool.unmapped[block.ptr]
        block.mapped = True
        if mapped < block.size:
            rest = Block(pool, block.ptr + mapped, block.size - mapped, mapped=False, expandable=True)
            rest.splice(block, block.next)
            pool.unmapped[rest.ptr] = rest
            block.size = mapped
        for neighbour in (block.prev, block.next):
            self.allocator._merge(block, neighbour)
        pool.insert(block)
        self.allocator._reserve(mapped)
        return True
