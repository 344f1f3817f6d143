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

from batchfit.errors import InputError
from batchfit.parallel import Parallelism
from batchfit.parallel import TinyTransformer
from batchfit.parallel import fit
from batchfit.parallel import trace_rank
from batchfit.parallel.counting import RankBytes
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.trace import RankSession
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


@pytest.mark.slow  # a second trace of a whole step; the per-rank peaks stay in make test
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
    # In a session, the first size's first step propagates for the later sizes too, and a later
    # size's one steady step peaks as its own trace does, with or without the propagation in it.
    _UncachedAdamW.made.clear()
    with RankSession(WIDE, 8, parallelism=settings, optimizer=lambda p: _UncachedAdamW(p, foreach=True)) as session:
        at_one, at_two = session.trace(1), session.trace(2)
    assert len(_UncachedAdamW.made) == 3 and min(_UncachedAdamW.made) > 0
    assert at_one.peak_bytes == steady.peak_bytes and at_one.breakdown == steady.breakdown
    fresh = trace_rank(WIDE, 2, 8, parallelism=settings)
    assert (at_two.peak_bytes, at_two.breakdown, at_two.phase_peaks_bytes) == (
        fresh.peak_bytes,
        fresh.breakdown,
        fresh.phase_peaks_bytes,
    )


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


def _synthetic(peak_of, phase_peaks_of=None):
    """A stand-in for ``RankSession`` whose traces peak at ``peak_of(batch_size)`` (with the phases'
    peaks ``phase_peaks_of(batch_size)`` when given)."""

    class Session:
        def __init__(self, model, seq_len, *, parallelism=None, **options):
            self.seq_len, self.steps_run = seq_len, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return None

        def trace(self, batch_size):
            self.steps_run += 1
            phases = phase_peaks_of(batch_size) if phase_peaks_of else {}
            peak = max(phases.values()) if phases else peak_of(batch_size)
            return ShardedEstimate(
                peak,
                {"activations": peak},
                8,
                batch_size,
                self.seq_len,
                "backward",
                Parallelism(world_size=8),
                phase_peaks_bytes=phases,
            )

    return Session


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
    monkeypatch.setattr(fit, "RankSession", _synthetic(peak_of))
    capacity = 3000
    truth = max(b for b in range(1, 500) if peak_of(b) <= capacity)
    found = largest_batch_size("any", 128, capacity)
    assert found.batch_size == truth and found.estimate.batch_size == truth
    assert found.above.batch_size == truth + 1 and found.above.peak_bytes > capacity
    assert found.traces <= most_traces


def test_the_largest_batch_when_none_fits_or_the_maximum_fits(monkeypatch) -> None:
    monkeypatch.setattr(fit, "RankSession", _synthetic(lambda b: 1000 + 10 * b))
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
    assert found.steps == 2 + found.traces - 1  # built and sharded once: one steady step a later size
    for traced in (found.estimate, found.above):  # each as its own trace says
        fresh = trace_rank(TinyTransformer, traced.batch_size, 16, parallelism=settings)
        assert (traced.peak_bytes, traced.breakdown) == (fresh.peak_bytes, fresh.breakdown)


def test_lines_by_phase_find_the_edge_when_the_peak_moves_to_another_phase(monkeypatch) -> None:
    # The optimizer step peaks at 1 and 2 (large model, small activations); backward overtakes it later.
    def phases(b: int) -> dict[str, int]:
        return {"forward": 100 + 30 * b, "backward": 500 + 50 * b, "optimizer": 2000 + b}

    monkeypatch.setattr(fit, "RankSession", _synthetic(None, phases))
    found = largest_batch_size("any", 128, 5000)
    assert (found.batch_size, found.above.batch_size, found.traces) == (90, 91, 4)  # 1, 2, 90, 91
    monkeypatch.setattr(fit, "RankSession", _synthetic(lambda b: max(phases(b).values())))
    assert largest_batch_size("any", 128, 5000).traces > 4  # the step's peak alone: a line that bends


# -- one session, several micro-batch sizes -------------------------------------------------------


class _Scratchy(TinyTransformer):
    """Its forward makes a large scratch tensor it does not keep, so the step peaks in the forward,
    while the previous step's output is still alive."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            offset = torch.ones(*input_ids.shape, 64 * self.norm.normalized_shape[0]).mean()
        return super().forward(input_ids) + offset


class _Caching(TinyTransformer):
    """Keeps a tensor as large as its last batch between steps (made anew when the batch changes)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if getattr(self, "cache", None) is None or self.cache.shape[0] != input_ids.shape[0]:
            self.cache = torch.zeros(*input_ids.shape, 256)
        return super().forward(input_ids)


def _llama_checkpointed():
    from fsdp_cases import CASES

    case = CASES["llama_checkpointed"]
    return case.spec(), case.parallelism(4)


def _same_step(one: ShardedEstimate, other: ShardedEstimate) -> tuple:
    fields = ("peak_bytes", "breakdown", "peak_phase", "phase_peaks_bytes", "state_bytes")
    return tuple(getattr(one, name) for name in fields), tuple(getattr(other, name) for name in fields)


@pytest.mark.parametrize(
    ("spec", "settings", "sizes"),
    [
        (
            functools.partial(_Scratchy, num_layers=2),
            Parallelism(world_size=2, activation_checkpointing="full"),
            (2, 3, 1),
        ),
        ("llama", None, (1, 3)),  # a Hugging Face Llama, bf16 compute and fp32 reduction, checkpointed
    ],
    ids=["peak-in-forward", "hf-llama-mixed-checkpointed"],
)
def test_a_session_traces_each_size_as_its_own_trace_does(spec, settings, sizes) -> None:
    if spec == "llama":
        pytest.importorskip("transformers")
        spec, settings = _llama_checkpointed()
    with RankSession(spec, 16, parallelism=settings) as session:
        traced = {size: session.trace(size) for size in sizes}  # up, then down
    assert session.steps_run == 2 + len(sizes) - 1  # the first size's two steps, then one steady step a size
    for size in sizes[1:]:
        fresh = trace_rank(spec, size, 16, parallelism=settings)
        mine, theirs = _same_step(traced[size], fresh)
        assert mine == theirs, size
        assert traced[size].step_peaks_bytes == (fresh.peak_bytes,)
    assert traced[3].peak_phase == ("forward" if settings.param_dtype is None else "backward")
    assert not dist.is_initialized()


def test_a_session_retraces_a_size_whose_step_changes_what_the_rank_keeps() -> None:
    settings = Parallelism(world_size=2)
    with RankSession(_Caching, 16, parallelism=settings) as session:
        session.trace(1)
        at_two = session.trace(2)
    assert session.steps_run == 2 + 1 + 2  # the steady step at 2 made a new cache: two more steps
    mine, theirs = _same_step(at_two, trace_rank(_Caching, 2, 16, parallelism=settings))
    assert mine == theirs


class _FailsAtThree(TinyTransformer):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 3:
            raise KeyError("the user's own error at micro-batch 3")
        return super().forward(input_ids)


def test_a_session_traces_only_inside_its_block_and_not_after_a_step_failed() -> None:
    session = RankSession(_FailsAtThree, 8, parallelism=Parallelism(world_size=2))
    with pytest.raises(InputError, match="inside its with block"):
        session.trace(1)
    with session:
        assert dist.is_initialized() and session.trace(1).batch_size == 1
        with pytest.raises(KeyError, match="own error"):
            session.trace(3)
        with pytest.raises(InputError, match="new RankSession"):
            session.trace(2)
    assert not dist.is_initialized()


def test_a_trace_leaves_untyped_storage_as_it_found_it():
    before = dict(torch.UntypedStorage.__dict__)
    trace_rank(TinyTransformer, 1, 8, parallelism=Parallelism(world_size=2))
    assert dict(torch.UntypedStorage.__dict__) == before  # resize_ watched only during the trace, then removed


def test_a_search_at_a_lower_capacity_reuses_the_traces_it_is_given(monkeypatch) -> None:
    entered: list[int] = []
    base = _synthetic(lambda b: 1000 + 37 * b)

    class Counted(base):
        def __enter__(self):
            entered.append(1)
            return super().__enter__()

    monkeypatch.setattr(fit, "RankSession", Counted)
    first = largest_batch_size("any", 128, 3000)
    assert (first.batch_size, first.traces, sorted(first.traced)) == (54, 4, [1, 2, 54, 55])  # 1000 + 37 * 54 = 2998
    fresh = largest_batch_size("any", 128, 2900)
    entered.clear()
    again = largest_batch_size("any", 128, 2900, known=first.traced)
    assert (again.batch_size, again.estimate, again.above) == (fresh.batch_size, fresh.estimate, fresh.above)
    assert again.batch_size == 51 and again.traces == 2 and len(entered) == 1  # only 51 and 52 were new
    entered.clear()
    same = largest_batch_size("any", 128, 3000, known=first.traced)
    assert (same.batch_size, same.traces, same.steps, entered) == (54, 0, 0, [])  # every size known: nothing built
