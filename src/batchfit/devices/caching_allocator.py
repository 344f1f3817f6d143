"""A model of PyTorch's CUDA caching allocator, run without a GPU: given the same requests and frees, it
reserves what the card's allocator would, and fails where it would.

On a GPU a batch size fits when the caching allocator can serve every request, not when the live bytes fit:
freed blocks stay cached in segments, a segment returns to the driver only when all of it is free, and a large
request can fail with gigabytes free in pieces. The rules below are torch's (``c10/cuda/CUDACachingAllocator.cpp``
and ``c10/core/CachingDeviceAllocator.h``, torch 2.13), each cited by the C++ name it follows:

- ``round_size``: requests round up to 512 bytes (``kMinBlockSize``), or to a power-of-2 division with
  ``roundup_power2_divisions``;
- ``get_pool``: up to 1 MiB (``kSmallSize``) from the small pool, larger from the large pool;
- ``get_allocation_size``: a new small segment is 2 MiB (``kSmallBuffer``), a large request under 10 MiB
  (``kMinLargeAlloc``) gets a 20 MiB segment (``kLargeBuffer``), a larger one its size rounded up to 2 MiB;
- ``get_free_block``: the smallest cached block at least as large (best fit, lowest address among equals),
  never an oversize block (``max_split_size``) for a smaller request;
- ``should_split``: the rest of a block returns to the pool when at least 512 bytes remain (small pool) or more
  than 1 MiB (large pool, request under ``max_split_size``); otherwise the block is handed out whole;
- ``malloc``: on a miss, garbage collection (``garbage_collection_threshold``, with a memory fraction), a new
  segment, then freeing oversize cached segments and retrying, then freeing every whole cached segment
  (``release_cached_blocks``, what ``torch.cuda.empty_cache`` does) and retrying; then out of memory;
- ``free_block``: a freed block merges with free neighbours of its segment;
- expandable segments (``expandable_segments:True``): one segment per pool that maps pages of 2 MiB (small) or
  20 MiB (large) at its end as it grows, and unmaps free pages, so a large request never fails for want of a
  contiguous hole: see ``batchfit.devices.expandable``.

Streams, CUDA graphs and private pools are not modelled: one stream, the default pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from batchfit.devices.allocator_blocks import SMALL_BUFFER_BYTES
from batchfit.devices.allocator_blocks import AllocatorStats
from batchfit.devices.allocator_blocks import Block
from batchfit.devices.allocator_blocks import Pool
from batchfit.devices.allocator_settings import LARGE_SEGMENT_BYTES
from batchfit.devices.allocator_settings import MIB
from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.expandable import Expandable

MIN_BLOCK_BYTES = 512  # kMinBlockSize
SMALL_SIZE_BYTES = MIB  # kSmallSize: the largest small-pool request
MIN_LARGE_ALLOC_BYTES = 10 * MIB  # kMinLargeAlloc: large requests below it share a 20 MiB segment
ROUND_LARGE_BYTES = 2 * MIB  # kRoundLarge


def round_size(size: int, settings: AllocatorSettings) -> int:
    """``round_size``: ``size`` up to 512 bytes, or to the next power-of-2 division where the size's interval
    has more than one (``roundup_power2_divisions``)."""
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    interval = min(max(size.bit_length() - 1 - 20, 0), len(settings.roundup_divisions) - 1)
    divisions = settings.roundup_divisions[interval]
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        return _next_division(size, divisions)
    return -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def _next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: 1200 in 4 divisions of [1024, 2048) -> 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    down = size & ~(step - 1)
    return size if down == size else down + step


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a request of ``size`` (rounded) makes when no cached block serves it."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-size // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES


class CachingAllocator:
    """The caching allocator of one device with ``capacity_bytes`` to give (``cudaMalloc`` fails past it).

    ``malloc(nbytes)`` returns the ``Block`` serving a request, or ``None`` where torch would raise out of memory
    (after every retry); ``free(block)`` returns it to the cache; ``empty_cache()`` is ``torch.cuda.empty_cache``.
    ``stats`` holds the allocated and reserved bytes and their peaks; ``reset_peak()`` starts new peaks.

    A 40 MiB hole between two live blocks of one 80 MiB segment cannot serve 48 MiB, and the segment cannot go
    back to the driver while any of it lives: 40 MiB live, yet 48 more do not fit in 120. Expandable segments
    unmap the hole's pages and map new ones at the end.

    >>> allocator = CachingAllocator(120 * MIB)
    >>> allocator.free(allocator.malloc(80 * MIB))      # an 80 MiB segment, now cached
    >>> a, b, c = (allocator.malloc(n * MIB) for n in (20, 40, 20))   # carved from it, front to back
    >>> allocator.free(b)
    >>> allocator.malloc(48 * MIB) is None, allocator.stats.allocated_bytes // MIB, allocator.stats.reserved_bytes // MIB
    (True, 40, 80)
    >>> expandable = CachingAllocator(120 * MIB, AllocatorSettings(expandable_segments=True))
    >>> expandable.free(expandable.malloc(80 * MIB))
    >>> a, b, c = (expandable.malloc(n * MIB) for n in (20, 40, 20))
    >>> expandable.free(b)
    >>> expandable.malloc(48 * MIB) is None, expandable.stats.reserved_bytes // MIB   # 40 live + 3 pages of 20
    (False, 100)
    """

    def __init__(self, capacity_bytes: int, settings: AllocatorSettings | None = None):
        self.capacity_bytes = capacity_bytes
        self.settings = settings or AllocatorSettings()
        fraction = self.settings.per_process_memory_fraction
        self.allowed_bytes = None if fraction is None or fraction >= 1 else int(fraction * capacity_bytes)
        self.small = Pool(small=True)
        self.large = Pool(small=False)
        self.stats = AllocatorStats()
        self.active: set[Block] = set()  # the blocks handed out
        self._next_address = 0
        self.expandable = Expandable(self) if self.settings.expandable_segments else None

    # -- requests ------------------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> Block | None:
        """The block serving a request of ``nbytes``, or ``None``: out of memory after every retry."""
        size = round_size(nbytes, self.settings)
        pool = self.small if size <= SMALL_SIZE_BYTES else self.large
        segment_bytes = allocation_size(size)
        block = self._free_block(pool, size)
        if block is None:
            if self.allowed_bytes is not None and self.settings.garbage_collection_threshold > 0:
                self._collect_garbage()
            block = (
                self._new_block(pool, size, segment_bytes)
                or (self._release_oversize(pool, size) and self._new_block(pool, size, segment_bytes))
                or (self._release_cached(retry=True) and self._new_block(pool, size, segment_bytes))
            )
        if block is None:
            self.stats.num_ooms += 1
            return None
        return self._hand_out(block, size, nbytes)

    def free(self, block: Block) -> None:
        """``free`` and ``free_block``: the block returns to its pool, merged with free neighbours."""
        self.active.discard(block)
        block.allocated = False
        self.stats.allocated_bytes -= block.size
        for neighbour in (block.prev, block.next):
            self._merge(block, neighbour)
        block.pool.insert(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: every whole free segment goes back to the driver (free pages unmapped)."""
        self._release_cached(retry=False)

    def reset_peak(self) -> None:
        self.stats.peak_allocated_bytes = self.stats.allocated_bytes
        self.stats.peak_reserved_bytes = self.stats.reserved_bytes

    def free_bytes(self) -> int:
        """What the driver could still give: the capacity less what is reserved."""
        return self.capacity_bytes - self.stats.reserved_bytes

    # -- the steps of malloc -------------------------------------------------------------------------------

    def _free_block(self, pool: Pool, size: int) -> Block | None:
        """``get_free_block``: best fit in ``pool``, within the oversize rules; taken out of the pool."""
        if self.allowed_bytes is not None and self.settings.garbage_collection_threshold > 0:
            pool.lookups += 1
        index = pool.at_least(size)
        if index == len(pool.keys):
            return None
        if self.expandable is not None:
            index = self.expandable.best_index(pool, index)
        block = pool.blocks[pool.keys[index][1]]
        limit = self.settings.max_split_size_bytes
        if limit is not None and size < limit <= block.size:
            return None  # do not return an oversized block for a large request
        if limit is not None and size >= limit and block.size >= size + self.settings.max_non_split_rounding_bytes:
            return None  # an oversized block may be rounded up, within a limit
        pool.erase(block)
        return block

    def _new_block(self, pool: Pool, size: int, segment_bytes: int) -> Block | None:
        """``alloc_block``: a new segment (or, expandable, new pages), or ``None`` past the capacity."""
        if self.allowed_bytes is not None and self.stats.reserved_bytes + segment_bytes > self.allowed_bytes:
            return None  # the memory fraction: checked against the segment size, even for expandable pages
        if self.expandable is not None:
            return self.expandable.grow(pool, size)
        if segment_bytes > self.free_bytes():
            return None  # cudaMalloc fails
        block = Block(pool, self._address(segment_bytes), segment_bytes)
        self._reserve(segment_bytes)
        return block

    def _hand_out(self, block: Block, size: int, nbytes: int) -> Block:
        """``alloc_found_block``: the front of ``block``, the rest back to the pool where ``should_split`` says so."""
        remaining = block.size - size
        if block.pool.small or self.expandable is not None:
            split = remaining >= MIN_BLOCK_BYTES
        else:
            limit = self.settings.max_split_size_bytes
            split = (limit is None or size < limit) and remaining > SMALL_SIZE_BYTES
        if split:
            rest = Block(block.pool, block.ptr + size, remaining, expandable=block.expandable)
            rest.splice(block, block.next)
            block.size = size
            block.pool.insert(rest)
        block.allocated = True
        self.active.add(block)
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)
        return block

    def _merge(self, block: Block, other: Block | None) -> int:
        """``try_merge_blocks``: ``other``, a free neighbour in the same state (mapped or not), joins ``block``."""
        if other is None or other.allocated or other.mapped != block.mapped:
            return 0
        other.pool.remove(other)
        if other is block.prev:
            block.ptr = other.ptr
            block.splice(other.prev, block.next)
        else:
            block.splice(block.prev, other.next)
        block.size += other.size
        return other.size

    # -- giving memory back --------------------------------------------------------------------------------

    def _release_oversize(self, pool: Pool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size``, free the smallest cached oversize
        segment that is large enough, else the largest ones until enough is freed."""
        limit = self.settings.max_split_size_bytes
        if limit is None:
            return False
        wanted = max(size, limit)
        whole = [pool.blocks[ptr] for _, ptr in pool.keys if not pool.blocks[ptr].expandable]
        larger = [b for b in whole if b.size >= wanted and not b.is_split()]
        if larger:
            self._release(larger[0])
            return True
        released = 0
        for block in sorted((b for b in whole if b.size >= limit and not b.is_split()), key=lambda b: -b.size):
            if released >= wanted:
                break
            released += block.size
            self._release(block)
        return released >= wanted

    def _release_cached(self, *, retry: bool) -> bool:
        """``release_cached_blocks``: every free block that is a whole segment goes back to the driver; free
        pages of expandable segments are unmapped."""
        if retry:
            self.stats.num_alloc_retries += 1
        for pool in (self.large, self.small):
            for _, ptr in list(pool.keys):
                block = pool.blocks.get(ptr)
                if block is None:
                    continue
                if block.expandable:
                    self.expandable.unmap(block)
                elif not block.is_split():
                    self._release(block)
        return True

    def _release(self, block: Block) -> None:
        """``release_block``: ``cudaFree`` of a whole free segment."""
        block.pool.erase(block)
        self._reserve(-block.size)
        self.stats.num_device_free += 1

    def _collect_garbage(self) -> None:
        """``garbage_collect_cached_blocks``: past ``garbage_collection_threshold`` of the allowed memory, free
        whole cached large segments at least as old (in cache lookups) as their average, until enough is back."""
        threshold = int(self.settings.garbage_collection_threshold * self.allowed_bytes)
        if self.stats.reserved_bytes <= threshold:
            return
        target, reclaimed = self.stats.reserved_bytes - threshold, 0
        pool = self.large
        ages = {ptr: pool.lookups - b.gc_base for ptr, b in pool.blocks.items() if not b.is_split()}
        while reclaimed < target and ages:
            average = sum(ages.values()) / len(ages)
            old = [ptr for _, ptr in pool.keys if ptr in ages and ages[ptr] >= average]
            if not old:
                break
            for ptr in old:
                del ages[ptr]
                block = pool.blocks[ptr]
                if not block.expandable:
                    reclaimed += block.size
                    self._release(block)

    # -- bookkeeping ---------------------------------------------------------------------------------------

    def _reserve(self, nbytes: int) -> None:
        self.stats.reserved_bytes += nbytes
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        if nbytes > 0:
            self.stats.num_device_alloc += 1

    def state_key(self, tags: Mapping[int, int] | None = None) -> tuple:
        """The allocator's state as a value equal for two allocators exactly when every later request and free
        is served alike: each segment in address order (new segments always come after), its pool, and its
        blocks' offsets, sizes, and whether each is handed out or mapped; with the garbage collector on, the
        free blocks' ages too. ``tags`` (``id(block)`` -> a number) names handed-out blocks that a later free
        will name: where they sit matters, not only that something sits there.

        >>> a, b = CachingAllocator(8 * MIB), CachingAllocator(8 * MIB)
        >>> a.free(a.malloc(1000)); _ = b.malloc(1000)
        >>> a.state_key() == b.state_key(), len(a.state_key())   # one 2 MiB segment each, held in b
        (False, 1)
        """
        tags = tags or {}
        aging = self.allowed_bytes is not None and self.settings.garbage_collection_threshold > 0
        blocks = [*self.active]
        for pool in (self.small, self.large):
            blocks += [*pool.blocks.values(), *pool.unmapped.values()]
        segments = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.ptr):
            layout, block = [], head
            while block is not None:
                age = block.pool.lookups - block.gc_base if aging and not block.allocated else 0
                tag = tags.get(id(block), -1) if block.allocated else -1
                layout.append((block.ptr - head.ptr, block.size, block.allocated, block.mapped, tag, age))
                block = block.next
            segments.append((head.pool.small, head.expandable, tuple(layout)))
        return tuple(segments)

    def rebuilt(self, settings: AllocatorSettings) -> CachingAllocator:
        """A fresh allocator with ``settings`` holding what this one hands out now, requested again in address
        order: the state a process with those settings would start from (held blocks it cannot serve are left out)."""
        twin = CachingAllocator(self.capacity_bytes, settings)
        for block in sorted(self.active, key=lambda b: b.ptr):
            twin.malloc(block.size)
        twin.reset_peak()
        return twin

    def copy(self) -> CachingAllocator:
        """An independent allocator in the same state: every block, free or handed out, copied and relinked."""
        new = CachingAllocator.__new__(CachingAllocator)
        new.__dict__.update(self.__dict__)
        new.stats = dataclasses.replace(self.stats)
        new.small, new.large = Pool(small=True), Pool(small=False)
        pools = {id(self.small): new.small, id(self.large): new.large}
        old_blocks = [*self.active]
        for pool in (self.small, self.large):
            pools[id(pool)].lookups = pool.lookups
            pools[id(pool)].keys = list(pool.keys)
            old_blocks += [*pool.blocks.values(), *pool.unmapped.values()]
        copies = {id(b): b.copy_to(pools[id(b.pool)]) for b in old_blocks}
        for block in old_blocks:
            twin = copies[id(block)]
            twin.prev = copies[id(block.prev)] if block.prev is not None else None
            twin.next = copies[id(block.next)] if block.next is not None else None
            if twin.allocated:
                continue
            (twin.pool.blocks if twin.mapped else twin.pool.unmapped)[twin.ptr] = twin
        new.active = {copies[id(b)] for b in self.active}
        new.expandable = self.expandable.copy_to(new) if self.expandable is not None else None
        return new

    def _address(self, nbytes: int) -> int:
        """A fresh address range of ``nbytes`` (segments never touch: blocks merge only within one)."""
        address = self._next_address
        self._next_address += -(-nbytes // ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES + ROUND_LARGE_BYTES
        return address
