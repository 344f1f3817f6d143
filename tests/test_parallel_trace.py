"""One rank's traced memory: sharding arithmetic, hybrid shard, the two known distortions, the
counter's view of FSDP2 (local shards, resized storages), and the largest micro-batch per rank."""

from __future__ import annotations

import functools
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from batchfit.parallel import Parallelism
from batchfit.parallel import TinyTransformer
from batchfit.parallel import fit
from batchfit.parallel import trace_rank
from batchfit.parallel.counting import RankBytes
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.trace import ShardedEstimate
from batchfit.parallel.trace import plain_batch_checks

# Wide enough that FSDP2's padding and the 512-byte blocks are well under 1% of the sharded state.
WIDE = functools.partial(TinyTransformer, vocab_size=1024, hidden_size=256, num_heads=4, num_layers=2)


def _within(share: float, measured: int, expected: float) -> bool:
    return abs(measured - expected) <= share * expected


def test_doubling_the_world_halves_the_sharded_state_and_leaves_activations() -> None:
    two, four = (trace_rank(WIDE, 2, 32, parallelism=Parallelism(world_size=n)) for n in (2, 4))
    for part in ("sharded_parameters", "gradients", "optimizer_state"):
        assert _within(0.01, four.state_bytes[part], two.state_bytes[part] / 2), part
    assert four.breakdown["activations"] == two.breakdown["activations"] > 0
    assert four.breakdown["unsharded_parameters"] == two.breakdown["unsharded_parameters"] > 0
    assert four.peak_bytes < two.peak_bytes


def test_hybrid_shard_matches_full_shard_within_a_node() -> None:
    full = trace_rank(WIDE, 2, 32, parallelism=Parallelism(world_size=2))
    hybrid = trace_rank(WIDE, 2, 32, parallelism=Parallelism(world_size=4, gpus_per_node=2, sharding="hybrid"))
    assert hybrid.state_bytes == full.state_bytes
    assert _within(0.01, hybrid.peak_bytes, full.peak_bytes)


def _clear_sharding_propagation_caches() -> None:
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


class _UncachedAdamW(torch.optim.AdamW):
    """AdamW whose every step meets DTensor's sharding propagation with empty caches, as the first
    step does, and records how many times the propagation made its global-shape fake tensors."""

    made: ClassVar[list[int]] = []
    calls: ClassVar[list[int]] = [0]

    def step(self, closure=None):
        _clear_sharding_propagation_caches()
        before = self.calls[0]
        result = super().step(closure)
        self.made.append(self.calls[0] - before)
        return result


def test_the_first_steps_sharding_propagation_is_not_in_the_peak(monkeypatch) -> None:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def counted(self, op_schema):
        _UncachedAdamW.calls[0] += 1
        return original(self, op_schema)

    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", counted)
    settings = Parallelism(world_size=4)
    steady = trace_rank(WIDE, 1, 8, parallelism=settings, steps=3)
    assert steady.step_peaks_bytes[1] == steady.step_peaks_bytes[2]  # the reported peak is a steady step's
    _UncachedAdamW.made.clear()
    uncached = trace_rank(
        WIDE, 1, 8, parallelism=settings, steps=3, optimizer=lambda p: _UncachedAdamW(p, foreach=True)
    )
    assert len(_UncachedAdamW.made) == 3 and min(_UncachedAdamW.made) > 0  # every step propagated, as a first does
    # The optimizer step, where the propagation runs, peaks at the same bytes with or without it.
    assert uncached.phase_peaks_bytes == steady.phase_peaks_bytes
    assert uncached.step_peaks_bytes == steady.step_peaks_bytes and uncached.breakdown == steady.breakdown


def test_the_packed_sequence_check_answers_as_for_a_real_plain_batch() -> None:
    masking = pytest.importorskip("transformers.masking_utils")
    with FakeTensorMode():
        positions = torch.arange(16).unsqueeze(0).expand(2, 16)
        assert masking.find_packed_sequence_indices(positions) is not None  # fake values: taken as packed
        with plain_batch_checks(2, 16):
            assert masking.find_packed_sequence_indices(positions) is None  # what real positions give
    assert masking.find_packed_sequence_indices(torch.arange(16).unsqueeze(0).expand(2, 16)) is None


def test_the_counter_follows_resized_storages_and_opens_dtensors() -> None:
    counter = RankBytes(rounding_bytes=1)
    gathered = torch.zeros(256)
    original = torch.UntypedStorage.resize_
    with counter.measuring():
        gathered.add_(1)  # an op sees it: counted
        assert counter.live_bytes == 1024
        gathered.untyped_storage().resize_(0)  # FSDP2 frees a gathered parameter this way
        assert counter.live_bytes == 0
        gathered.untyped_storage().resize_(2048)
        assert counter.live_bytes == 2048 and counter.breakdown() == {"unsharded_parameters": 2048}
    assert torch.UntypedStorage.resize_ is original  # watched only while measuring
    with _world(4) as mesh:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import distribute_tensor

        sharded = distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])
        counter = RankBytes(rounding_bytes=1)
        counter.track(sharded, "sharded_parameters")
        assert counter.live_bytes == 64 * 8 * 4 // 4  # the local shard, not the global wrapper


def _world(ranks: int):
    from batchfit.parallel import fake_world

    return fake_world(Parallelism(world_size=ranks))


def test_a_trace_of_one_step_after_another_holds_only_the_state_between_steps() -> None:
    estimate = trace_rank(WIDE, 2, 32, parallelism=Parallelism(world_size=2), steps=3)
    assert estimate.step_peaks_bytes[1] == estimate.step_peaks_bytes[2]
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes
    assert set(estimate.to_dict()) >= {"peak_bytes", "breakdown", "world_size", "batch_size", "state_bytes"}
    assert not dist.is_initialized()


# -- the largest micro-batch, on synthetic traces and on a real one --------------------------------


def _synthetic(peak_of):
    def trace(model, batch_size, seq_len, *, parallelism=None, **options):
        return ShardedEstimate(
            peak_of(batch_size),
            {"activations": peak_of(batch_size)},
            8,
            batch_size,
            seq_len,
            "backward",
            Parallelism(world_size=8),
        )

    return trace


@pytest.mark.parametrize(
    ("peak_of", "most_traces"),
    [
        (lambda b: 1000 + 37 * b, 4),  # a line: 1, 2, the answer, the answer + 1
        (lambda b: 1000 + 512 * -(-37 * b // 512), 16),  # a line in 512-byte blocks, flat from 1 to 2
        (lambda b: 1000 + 3 * b * b, 16),  # growing faster than the line
        (lambda b: 1000 + 37 * b + (200 if b > 40 else 0), 16),  # the peak moves to another phase
    ],
)
def test_the_largest_batch_is_a_traced_size_next_to_a_traced_failure(monkeypatch, peak_of, most_traces) -> None:
    monkeypatch.setattr(fit, "trace_rank", _synthetic(peak_of))
    capacity = 3000
    truth = max(b for b in range(1, 500) if peak_of(b) <= capacity)
    found = largest_batch_size("any", 128, capacity)
    assert found.batch_size == truth and found.estimate.batch_size == truth
    assert found.above.batch_size == truth + 1 and found.above.peak_bytes > capacity
    assert found.traces <= most_traces


def test_the_largest_batch_when_none_fits_or_the_maximum_fits(monkeypatch) -> None:
    monkeypatch.setattr(fit, "trace_rank", _synthetic(lambda b: 1000 + 10 * b))
    assert largest_batch_size("any", 128, 500).batch_size == 0
    capped = largest_batch_size("any", 128, 10**9, max_batch_size=64)
    assert (capped.batch_size, capped.above) == (64, None)


def test_the_largest_batch_on_fake_fsdp2_traces() -> None:
    settings = Parallelism(world_size=2)
    found = largest_batch_size(TinyTransformer, 16, "2500KiB", parallelism=settings)
    assert isinstance(found, LargestBatch) and found.batch_size > 2 and found.traces <= 6
    assert found.estimate.peak_bytes <= 2500 * 1024 < found.above.peak_bytes
    assert (found.estimate.batch_size, found.above.batch_size) == (found.batch_size, found.batch_size + 1)
    assert found.to_dict()["largest_batch_size"] == found.batch_size
