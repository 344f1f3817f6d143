"""Replay a step's requests and frees through the caching allocator model, at any sizes.

A counting device logs, in order, every storage a trial made and freed (``LiveBytes.event_log``) and the
allocator's state when the trial began (``LiveBytes.allocator_at_start``). Replaying that order with other sizes
(the storages' bytes at another batch size, drawn as lines through two trials) says whether the card's allocator
would serve every request of a step at that size: fragmentation decides it, so no sum of bytes can.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchfit.devices.caching_allocator import CachingAllocator


@dataclass(frozen=True)
class Replay:
    """The outcome: whether every request was served within the capacity, and the peaks on the way."""

    served: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int


def replay(start: CachingAllocator, events: np.ndarray, sizes: np.ndarray, capacity_bytes: int | None = None) -> Replay:
    """Run ``events`` (``i + 1``: storage ``i`` made with ``sizes[i]`` bytes; ``-(i + 1)``: freed) through a copy of
    ``start`` (left as it is), with ``capacity_bytes`` in place of its own where given; stop at the first request
    it cannot serve."""
    allocator = start.copy()
    if capacity_bytes is not None:
        allocator.capacity_bytes = capacity_bytes
    allocator.reset_peak()
    blocks: list = [None] * len(sizes)
    malloc, free = allocator.malloc, allocator.free
    for event in events.tolist():
        if event > 0:
            block = malloc(int(sizes[event - 1]))
            if block is None:
                return Replay(False, allocator.stats.peak_reserved_bytes, allocator.stats.peak_allocated_bytes)
            blocks[event - 1] = block
        else:
            block = blocks[-event - 1]
            if block is not None:
                free(block)
                blocks[-event - 1] = None
    return Replay(True, allocator.stats.peak_reserved_bytes, allocator.stats.peak_allocated_bytes)


def events_from_lifetimes(born: np.ndarray, freed: np.ndarray, length: int) -> np.ndarray:
    """An event order from each storage's first and last timeline index (where no order was logged): at each
    op, the storages freed before it first, then those it made, in the order they were made, then those it made
    and freed within itself. Those that outlive the timeline are never freed.

    >>> events_from_lifetimes(np.array([0, 1, 1]), np.array([2, 1, 3]), 3).tolist()
    [1, 2, 3, -2, -1]
    """
    index = np.arange(len(born))
    made = np.stack([born, np.ones_like(born), index, index + 1], axis=1)
    gone = freed < length
    freed_order = np.where(freed[gone] == born[gone], 2, 0)
    frees = np.stack([freed[gone], freed_order, index[gone], -(index[gone] + 1)], axis=1)
    table = np.concatenate([made, frees])
    order = np.lexsort((table[:, 2], table[:, 1], table[:, 0]))
    return table[order, 3]
