"""The CUDA caching allocator model against sequences whose outcome torch's rules fix (``CUDACachingAllocator.cpp``):
rounding, pools, segment sizes, best fit and splitting, ``max_split_size``, garbage collection, freeing the cache
and retrying, expandable segments; and, on random sequences, the invariants every state must keep."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from batchfit.devices.allocator_settings import AllocatorSettings
from batchfit.devices.caching_allocator import MIB
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.caching_allocator import allocation_size
from batchfit.devices.caching_allocator import round_size
from batchfit.errors import InputError

GIB = 1024 * MIB
DEFAULT = AllocatorSettings()
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def mib(nbytes: int) -> float:
    return nbytes / MIB


def test_requests_round_to_512_bytes_or_to_a_power_of_two_division():
    assert [round_size(n, DEFAULT) for n in (1, 512, 513, 1000 * 1000)] == [512, 512, 1024, 1000448]
    four = AllocatorSettings.parse("roundup_power2_divisions:4")
    assert round_size(int(1.2 * MIB), four) == int(1.25 * MIB)  # [1, 2) MiB in steps of 256 KiB
    assert round_size(1200, four) == 1536  # at most 512 x divisions: plain 512-byte rounding
    assert round_size(2 * MIB, four) == 2 * MIB  # a power of two stays


def test_a_new_segment_is_2_MiB_small_20_MiB_below_10_MiB_else_the_size_in_2_MiB_steps():
    assert [mib(allocation_size(n)) for n in (512, MIB, MIB + 512, 10 * MIB - 512, 10 * MIB, 10 * MIB + 512)] == [
        2,
        2,
        20,
        20,
        10,
        12,
    ]


def test_small_requests_share_2_MiB_segments():
    allocator = CachingAllocator(GIB)
    blocks = [allocator.malloc(512) for _ in range(4096)]  # 4096 x 512 B fill one segment exactly
    assert allocator.stats.reserved_bytes == 2 * MIB and allocator.stats.allocated_bytes == 2 * MIB
    blocks.append(allocator.malloc(1))
    assert allocator.stats.reserved_bytes == 4 * MIB
    for block in blocks:
        allocator.free(block)
    assert allocator.stats.allocated_bytes == 0 and allocator.stats.reserved_bytes == 4 * MIB  # cached
    allocator.empty_cache()
    assert allocator.stats.reserved_bytes == 0


def test_large_requests_below_10_MiB_share_a_20_MiB_segment_and_a_small_rest_is_not_split_off():
    allocator = CachingAllocator(GIB)
    for _ in range(3):
        allocator.malloc(6 * MIB)
    assert mib(allocator.stats.reserved_bytes) == 20 and mib(allocator.stats.allocated_bytes) == 18
    allocator.malloc(6 * MIB)  # 2 MiB left in the first segment: a second one
    assert mib(allocator.stats.reserved_bytes) == 40
    whole = CachingAllocator(GIB)
    block = whole.malloc(int(19.5 * MIB))  # 0.5 MiB would remain: not more than 1 MiB, so not split off
    assert mib(block.size) == 20 and mib(whole.stats.allocated_bytes) == 20


def test_best_fit_takes_the_smallest_cached_block_large_enough():
    allocator = CachingAllocator(GIB)
    big, small = allocator.malloc(30 * MIB), allocator.malloc(12 * MIB)
    allocator.free(big)
    allocator.free(small)
    chosen = allocator.malloc(11 * MIB)
    assert chosen.ptr == small.ptr and mib(allocator.stats.reserved_bytes) == 42


def test_a_hole_between_live_blocks_cannot_serve_a_larger_request():
    """Fragmentation: 40 MiB live of 80 reserved, a 40 MiB hole; 48 more fail in 120 MiB on the default
    allocator, after freeing the cache and retrying; exact byte counting would fit them (88 <= 120)."""
    allocator = CachingAllocator(120 * MIB)
    allocator.free(allocator.malloc(80 * MIB))
    a, b, c = (allocator.malloc(n * MIB) for n in (20, 40, 20))
    assert (b.ptr - a.ptr, c.ptr - b.ptr) == (20 * MIB, 40 * MIB)  # carved front to back from one segment
    allocator.free(b)
    assert allocator.malloc(48 * MIB) is None
    assert (allocator.stats.num_alloc_retries, allocator.stats.num_ooms) == (1, 1)
    assert mib(allocator.stats.reserved_bytes) == 80  # the split segment could not go back
    assert allocator.malloc(40 * MIB).ptr == b.ptr  # the hole serves what fits in it
    allocator.free(a)
    allocator.free(c)


def test_freeing_the_cache_on_a_miss_returns_whole_segments_and_the_retry_succeeds():
    allocator = CachingAllocator(100 * MIB)
    for size in (30, 40):
        allocator.free(allocator.malloc(size * MIB))
    live = allocator.malloc(20 * MIB)  # best fit: the 30 MiB segment, split
    assert mib(allocator.stats.reserved_bytes) == 70
    allocator.malloc(50 * MIB)  # 70 + 50 > 100: the whole cached 40 MiB segment goes, then it fits
    assert mib(allocator.stats.reserved_bytes) == 80 and allocator.stats.num_alloc_retries == 1
    assert live.allocated


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    limited = CachingAllocator(GIB, AllocatorSettings.parse("max_split_size_mb:20"))
    limited.free(limited.malloc(40 * MIB))
    limited.malloc(5 * MIB)  # the cached 40 MiB block is oversize: a new 20 MiB segment
    assert mib(limited.stats.reserved_bytes) == 60
    whole = limited.malloc(30 * MIB)  # 40 < 30 + 20: the oversize block serves it, whole
    assert mib(whole.size) == 40 and mib(limited.stats.reserved_bytes) == 60
    default = CachingAllocator(GIB)
    default.free(default.malloc(40 * MIB))
    default.malloc(5 * MIB)
    assert mib(default.stats.reserved_bytes) == 40


def test_max_split_size_frees_an_oversize_cached_block_before_freeing_everything():
    allocator = CachingAllocator(100 * MIB, AllocatorSettings.parse("max_split_size_mb:20"))
    allocator.free(allocator.malloc(40 * MIB))
    allocator.malloc(50 * MIB)
    assert allocator.malloc(5 * MIB) is not None  # 90 + 20 > 100: the 40 MiB oversize segment is released
    assert mib(allocator.stats.reserved_bytes) == 70 and allocator.stats.num_alloc_retries == 0


def test_garbage_collection_frees_the_oldest_cached_segments_under_a_memory_fraction():
    conf = "per_process_memory_fraction:0.5,garbage_collection_threshold:0.5"
    collected = CachingAllocator(200 * MIB, AllocatorSettings.parse(conf))  # 100 MiB allowed, collect past 50
    collected.free(collected.malloc(30 * MIB))  # older
    collected.free(collected.malloc(40 * MIB))  # one lookup younger
    collected.malloc(44 * MIB)
    assert mib(collected.stats.reserved_bytes) == 84 and collected.stats.num_alloc_retries == 0  # the 30 went
    plain = CachingAllocator(200 * MIB, AllocatorSettings.parse("per_process_memory_fraction:0.5"))
    plain.free(plain.malloc(30 * MIB))
    plain.free(plain.malloc(40 * MIB))
    plain.malloc(44 * MIB)  # 70 + 44 > 100 allowed: everything cached goes, after a retry
    assert mib(plain.stats.reserved_bytes) == 44 and plain.stats.num_alloc_retries == 1


def test_expandable_segments_unmap_a_holes_pages_and_grow_at_the_end():
    allocator = CachingAllocator(120 * MIB, EXPANDABLE)
    allocator.free(allocator.malloc(80 * MIB))
    _, b, c = (allocator.malloc(n * MIB) for n in (20, 40, 20))
    allocator.free(b)
    block = allocator.malloc(48 * MIB)
    assert block is not None and block.ptr > c.ptr  # mapped after c, the hole's two pages unmapped
    assert mib(allocator.stats.reserved_bytes) == 100 and mib(allocator.stats.allocated_bytes) == 88


def test_expandable_segments_map_whole_pages_and_keep_partly_used_ones():
    allocator = CachingAllocator(GIB, EXPANDABLE)
    first = allocator.malloc(25 * MIB)  # two 20 MiB pages
    assert mib(allocator.stats.reserved_bytes) == 40 and mib(first.size) == 25
    second = allocator.malloc(10 * MIB)  # from the 15 MiB left on the second page
    assert second.ptr == first.ptr + 25 * MIB and mib(allocator.stats.reserved_bytes) == 40
    allocator.free(first)
    allocator.empty_cache()  # [0, 25) free: only the first page is whole
    assert mib(allocator.stats.reserved_bytes) == 20


def test_a_copy_is_independent_and_behaves_the_same():
    for conf in (DEFAULT, EXPANDABLE):
        allocator = CachingAllocator(200 * MIB, conf)
        blocks = [allocator.malloc(n * MIB) for n in (3, 30, 7, 12)]
        allocator.free(blocks[1])
        twin = allocator.copy()
        assert twin.malloc(50 * MIB) is not None and twin.malloc(80 * MIB) is not None
        assert allocator.stats.reserved_bytes < twin.stats.reserved_bytes  # the original did not change
        again = allocator.copy()
        assert [b is not None for b in (again.malloc(50 * MIB), again.malloc(80 * MIB))] == [True, True]
        assert again.stats == twin.stats


def test_settings_parse_as_torch_parses_them():
    parsed = AllocatorSettings.parse(
        " expandable_segments : True , max_split_size_mb:128,garbage_collection_threshold:0.6"
    )
    assert parsed.expandable_segments and parsed.max_split_size_bytes == 128 * MIB
    assert parsed.garbage_collection_threshold == 0.6
    listed = AllocatorSettings.parse("roundup_power2_divisions:[64:8,256:4,>:2]")
    assert listed.roundup_divisions[:6] == (8,) * 6  # the first entry fills the intervals below it
    assert listed.roundup_divisions[6:10] == (8, 0, 4, 2)  # [128, 256) MiB not named: none
    assert listed.roundup_divisions[15] == 2
    assert AllocatorSettings.parse("backend:native,pinned_use_cuda_host_register:True") == DEFAULT
    assert AllocatorSettings.parse(parsed.to_conf()) == parsed


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("expandable_segments:true", "True or False"),
        ("max_split_size_mb:10", "at least 20"),
        ("garbage_collection_threshold:1.5", r"in \(0, 1\)"),
        ("roundup_power2_divisions:3", "power of 2"),
        ("max_split_size_mb", "key:value"),
        ("expandable:True", "unknown allocator setting 'expandable'"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_key(text, match):
    with pytest.raises(InputError, match=match):
        AllocatorSettings.parse(text)


def test_the_processs_settings_are_what_torch_parsed_else_its_environment(monkeypatch):
    """torch parses the environment once, lazily, and keeps the last string it was given: that string wins. (The
    getter is replaced here: calling torch's own would make it parse this test's environment for good.)"""
    import torch

    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "max_split_size_mb:64", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert AllocatorSettings.from_process() == AllocatorSettings(max_split_size_bytes=64 * MIB)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    assert AllocatorSettings.from_process() == EXPANDABLE
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")
    assert AllocatorSettings.from_process().garbage_collection_threshold == 0.8


def check_invariants(allocator: CachingAllocator) -> None:
    """Blocks tile their segments, free neighbours are merged, the stats add up, nothing passes the capacity."""
    blocks = [*allocator.active]
    for pool in (allocator.small, allocator.large):
        assert sorted(pool.keys) == pool.keys and len(pool.keys) == len(pool.blocks)
        assert all(pool.blocks[ptr].size == size for size, ptr in pool.keys)
        blocks += [*pool.blocks.values(), *pool.unmapped.values()]
    mapped = 0
    for block in blocks:
        if block.next is not None:
            assert block.next.prev is block and block.next.ptr == block.ptr + block.size
            if not block.allocated and not block.next.allocated:
                assert block.mapped != block.next.mapped  # two free blocks side by side would have merged
        mapped += block.size if block.mapped else 0
    assert mapped == allocator.stats.reserved_bytes
    assert sum(b.size for b in allocator.active) == allocator.stats.allocated_bytes
    assert allocator.stats.allocated_bytes <= allocator.stats.reserved_bytes <= allocator.capacity_bytes


requests = st.lists(st.tuples(st.booleans(), st.integers(1, 40 * MIB), st.integers(0, 1000)), min_size=1, max_size=80)


@settings(max_examples=60, deadline=None)
@given(
    requests, st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:20", "roundup_power2_divisions:4"])
)
def test_random_sequences_keep_every_invariant(steps, conf):
    allocator = CachingAllocator(160 * MIB, AllocatorSettings.parse(conf))
    live = []
    for allocate, nbytes, pick in steps:
        if allocate or not live:
            block = allocator.malloc(nbytes)
            if block is not None:
                assert block.size >= nbytes
                live.append(block)
        else:
            allocator.free(live.pop(pick % len(live)))
        check_invariants(allocator)
    for block in live:
        allocator.free(block)
    allocator.empty_cache()
    check_invariants(allocator)
    assert allocator.stats.allocated_bytes == 0
    if not conf.startswith("expandable"):
        assert allocator.stats.reserved_bytes == 0
