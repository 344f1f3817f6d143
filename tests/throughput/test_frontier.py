"""The checkpointing frontier: each policy's largest micro-batch is the search's under that policy, the choice
for a global batch follows the samples/s measured (exact arithmetic on made-up points), the model is as it was
afterwards, and an out-of-memory error inside a recomputed block leaves the state whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.step.checkpointing import checkpointing
from batchfit.throughput import FrontierChoice
from batchfit.throughput import PolicyFrontier
from batchfit.throughput import ThroughputPoint
from batchfit.throughput import ThroughputResult
from batchfit.throughput.frontier_result import choose
from batchfit.throughput.frontier_result import policy_candidate
from state_checks import assert_same
from state_checks import fingerprint
from state_checks import train_a_little


def _timed(policy: str, largest: int, seconds_of, held: int | None = None) -> PolicyFrontier:
    """A policy whose step at batch b took ``seconds_of(b)`` seconds, timed at the powers of two up to ``largest``."""
    sizes = sorted({1 << k for k in range(largest.bit_length()) if 1 << k <= largest} | {largest})
    points = [ThroughputPoint(b, seconds_of(b), b / seconds_of(b), None, 1000 * b) for b in sizes]
    best = max(points, key=lambda p: p.samples_per_second).batch_size
    result = ThroughputResult(best, best, largest, 0.05, points, 0.0, 0.0, "")
    return PolicyFrontier(policy, largest, held, 1000 * largest, result)


# A fixed cost of 40 ms a step and 1 ms a sample; checkpointing every block costs a third more per sample.
PLAIN = _timed("none", 4, lambda b: 0.040 + 0.001 * b, held=4)
FULL = _timed("full", 32, lambda b: 0.040 + 0.00133 * b, held=32)


def test_checkpointing_pays_where_it_cuts_accumulation_steps_that_cost_more_than_its_recompute() -> None:
    candidates = [policy_candidate(p, 64) for p in (PLAIN, FULL)]
    assert [(c.micro_batch_size, c.accumulation_steps) for c in candidates] == [(4, 16), (32, 2)]
    assert candidates[0].samples_per_second == pytest.approx(4 / 0.044)
    assert candidates[1].samples_per_second == pytest.approx(32 / (0.040 + 0.00133 * 32))
    chosen, reason = choose(candidates, 0.05)
    assert chosen.policy == "full" and "most samples per second" in reason


def test_checkpointing_does_not_pay_where_the_global_batch_fits_without_it() -> None:
    candidates = [policy_candidate(p, 4) for p in (PLAIN, FULL)]
    assert [(c.policy, c.micro_batch_size, c.accumulation_steps) for c in candidates] == [
        ("none", 4, 1),
        ("full", 4, 1),
    ]
    assert choose(candidates, 0.0)[0].policy == "none"  # the same split, recomputing costs time


def test_a_later_micro_batch_is_held_to_the_accumulating_limit_and_devices_split_the_batch() -> None:
    held_back = _timed("full", 32, lambda b: 0.040 + 0.00133 * b, held=16)
    candidate = policy_candidate(held_back, 128, devices=2)
    assert (candidate.micro_batch_size, candidate.accumulation_steps, candidate.devices) == (16, 4, 2)
    assert candidate.samples_per_second == pytest.approx(2 * 16 / (0.040 + 0.00133 * 16))
    assert policy_candidate(PolicyFrontier("full", 0), 64) is None


def test_within_tolerance_the_policy_recomputing_least_is_chosen_and_untimed_is_by_memory() -> None:
    near = [
        FrontierChoice("full", 32, 2, samples_per_second=100.0),
        FrontierChoice("none", 8, 8, samples_per_second=97.0),
    ]
    assert choose(near, 0.05)[0].policy == "none" and choose(near, 0.01)[0].policy == "full"
    untimed = [FrontierChoice("full", 32, 2), FrontierChoice("selective", 16, 4)]
    assert choose(untimed, 0.05)[0].policy == "full"  # the fewest accumulation steps
    assert choose([*untimed, FrontierChoice("none", 8, 8)], 0.05)[0].policy == "none"


class Blocks(nn.Module):
    """Four blocks with a wide hidden layer: checkpointing keeps only each block's narrow input."""

    def __init__(self, width: int = 32, hidden: int = 512):
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(4)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _work() -> bf.Workload:
    torch.manual_seed(0)
    model = Blocks()
    return bf.Workload(
        model,
        (torch.randn(4, 32), torch.randn(4, 32)),
        loss_fn=nn.functional.mse_loss,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    )


def test_each_policys_largest_is_the_searchs_under_it_and_the_model_is_as_it_was() -> None:
    work = _work()
    train_a_little(work)
    before = fingerprint(work)
    device = bf.SimulatedDevice("2MiB")
    found = bf.throughput.frontier_for_workload(
        work, "none,full", device=device, global_batch_size=96, timing_warmup_steps=0, timed_steps=1, refine_rounds=0
    )
    assert_same(before, fingerprint(work))
    assert all("forward" not in vars(block) for block in work.model.layers)
    largest = {p.policy: p.largest_batch_size for p in found.policies}
    for policy in ("none", "full"):
        with checkpointing(work.model, policy):
            assert bf.search_workload(work, device=device).batch_size == largest[policy]
    assert largest["full"] > largest["none"] >= 1
    choice = found.choice
    assert choice.micro_batch_size * choice.accumulation_steps == 96
    assert choice.micro_batch_size <= found.policies[[p.policy for p in found.policies].index(choice.policy)].limit(2)
    assert found.to_dict()["choice"]["policy"] == choice.policy
    assert "side by side" in found.notes[-1] and choice in found.candidates  # chosen from the turns' timings
    for c in found.candidates:  # a window's micro-batches, its optimizer step once
        assert c.step_seconds and c.optimizer_seconds is not None
        window = c.accumulation_steps * c.step_seconds - (c.accumulation_steps - 1) * c.optimizer_seconds
        assert c.samples_per_second == pytest.approx(c.micro_batch_size * c.accumulation_steps / window)


def test_on_a_trace_nothing_is_timed_and_the_choice_is_by_memory() -> None:
    work = _work()
    found = bf.throughput.frontier_for_workload(work, "none,full", device=bf.TraceDevice("2MiB"), global_batch_size=512)
    assert not found.timed and all(p.throughput is None for p in found.policies)
    plain = found.policies[0]
    expected = "none" if policy_candidate(plain, 512) is not None else "full"
    assert found.choice.policy == expected and found.choice.samples_per_second is None


def test_an_oom_inside_a_recomputed_block_leaves_the_state_whole() -> None:
    """Under full checkpointing the peak is in backward, where each block's forward runs again: one above the
    largest fails there. The sizes tried are a bisection's, and the state is restored after each."""
    work = _work()
    train_a_little(work)
    before = fingerprint(work)
    device = bf.SimulatedDevice("2MiB")
    with checkpointing(work.model, "full"):
        result = bf.search_workload(work, device=device, strategy="binary", min_batch_size=1, max_batch_size=256)
        edge = min((t for t in result.trials if not t.fits), key=lambda t: t.batch_size)
        assert edge.batch_size == result.batch_size + 1 and edge.oom and edge.failed_phase == "backward"
        tried = [t.batch_size for t in result.trials]
        assert tried == _binary_sizes(result.batch_size, 1, 256)
    assert_same(before, fingerprint(work))
    assert bf.probe_batch_size(work.model, work.sample_batch, result.batch_size, loss_fn=work.loss_fn).fits


def _binary_sizes(answer: int, low: int, high: int) -> list[int]:
    """The sizes a bisection over [low, high] tries when ``answer`` is the largest that fits."""
    tried = []
    while low <= high:
        middle = (low + high) // 2
        tried.append(middle)
        low, high = (middle + 1, high) if middle <= answer else (low, middle - 1)
    return tried


def test_a_window_of_accumulation_steps_is_charged_one_optimizer_step() -> None:
    from batchfit.throughput.side_by_side import _retimed

    candidate = FrontierChoice("none", 8, 4, global_batch_size=32)
    retimed = _retimed(candidate, [0.05, 0.05, 0.05], [0.01, 0.01, 0.01])
    assert retimed.samples_per_second == pytest.approx(32 / (4 * 0.05 - 3 * 0.01))
    assert retimed.optimizer_step_seconds == pytest.approx(0.17)
    whole = _retimed(FrontierChoice("full", 32, 1, global_batch_size=32), [0.15], [0.01])
    assert whole.samples_per_second == pytest.approx(32 / 0.15)  # one micro-batch: its own optimizer step


def test_a_trial_times_its_optimizer_steps_within_its_steps() -> None:
    from batchfit.search.prober import Prober

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    work = bf.Workload(model, (torch.randn(4, 16), torch.randint(0, 4, (4,))), nn.functional.cross_entropy,
                       torch.optim.AdamW(model.parameters()))  # fmt: skip
    device = bf.SimulatedDevice("16MiB")
    with Prober(device.prepare(work), device, steps=3) as prober:
        trial = prober.probe(8)
    assert trial.fits and len(trial.optimizer_seconds) == len(trial.step_seconds) == 3
    assert all(0 < o < s for o, s in zip(trial.optimizer_seconds, trial.step_seconds, strict=True))


def test_a_policys_split_is_timed_as_a_window_with_one_optimizer_step() -> None:
    """Two splits of 64 at 10 ms of optimizer step: 4 x 16 runs 15 optimizer steps fewer than 16 timed full steps."""
    points = [
        ThroughputPoint(b, 0.040 + 0.001 * b, b / (0.040 + 0.001 * b), None, None, timed_optimizer_seconds=(0.010,))
        for b in (4, 16)
    ]
    result = ThroughputResult(16, 16, 16, 0.05, points, 0.0, 0.0, "")
    frontier = PolicyFrontier("none", 16, 16, 16_000, result)
    chosen = policy_candidate(frontier, 64)
    assert (chosen.micro_batch_size, chosen.accumulation_steps) == (16, 4)
    assert chosen.samples_per_second == pytest.approx(64 / (4 * 0.056 - 3 * 0.010))
    small = policy_candidate(PolicyFrontier("none", 4, 4, 4_000, result), 64)  # only 4 x 16 fits
    assert (small.micro_batch_size, small.accumulation_steps) == (4, 16)
    assert small.samples_per_second == pytest.approx(64 / (16 * 0.044 - 15 * 0.010))
