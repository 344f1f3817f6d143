"""find_optimal_batch_size on a workload whose step time is alpha + beta*B by construction."""

from __future__ import annotations

import json
import math

import pytest
import torch

from batchfit.devices.simulated import SimulatedDevice
from batchfit.throughput import find_optimal_batch_size

ALPHA, BETA = 0.01, 1e-4  # seconds, seconds per sample


class FakeClock:
    """Time advances only when a step runs, by exactly alpha + beta*B."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_workload():
    clock = FakeClock()
    model = torch.nn.Linear(4, 1)

    def step_fn(model, batch):
        clock.now += ALPHA + BETA * batch.shape[0]
        return model(batch).mean()

    return model, torch.randn(2, 4), step_fn, clock


def optimal(**kwargs):
    model, batch, step_fn, clock = timed_workload()
    return find_optimal_batch_size(model, batch, step_fn=step_fn, device="sim:64MiB", clock=clock, **kwargs)


def analytic_choice(tolerance: float, top: int) -> int:
    """Smallest B with B/(alpha+beta*B) >= (1 - tolerance) * top/(alpha+beta*top)."""
    target = (1 - tolerance) * top / (ALPHA + BETA * top)
    return math.ceil(target * ALPHA / (1 - target * BETA))


def test_the_fit_recovers_alpha_beta_and_the_knees():
    result = optimal(max_batch_size=1024)
    assert result.alpha_seconds == pytest.approx(ALPHA) and result.beta_seconds_per_sample == pytest.approx(BETA)
    assert result.knee(0.90) == pytest.approx(9 * ALPHA / BETA) and result.knee(0.95) == pytest.approx(
        19 * ALPHA / BETA
    )
    assert result.best_batch_size == 1024


def test_it_picks_the_analytically_right_batch():
    result = optimal(max_batch_size=1024, refine_rounds=12)
    assert result.batch_size == analytic_choice(0.05, 1024) == 644
    assert result.point(644).samples_per_second >= 0.95 * result.point(1024).samples_per_second
    assert result.point(643).samples_per_second < 0.95 * result.point(1024).samples_per_second
    assert {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024} <= {
        p.batch_size for p in result.points
    }  # the grid, then refinement


def test_memory_saved_versus_the_maximum_is_reported():
    result = optimal(max_batch_size=1024)
    assert result.memory_saved_bytes == result.point(1024).peak_bytes - result.point(result.batch_size).peak_bytes > 0
    assert (
        f"Use batch size {result.batch_size}:" in result.summary()
        and "less memory than the maximum" in result.summary()
    )


def test_a_safety_fraction_keeps_below_a_share_of_the_maximum():
    result = optimal(max_batch_size=1000, safety_fraction=0.5)
    assert max(p.batch_size for p in result.points) == 500 and result.batch_size <= 500
    assert "kept below 50% of the maximum (1000): at most 500" in result.notes


def test_a_time_budget_picks_the_smallest_batch_whose_epoch_fits():
    result = optimal(max_batch_size=1024, dataset_size=100_000, time_budget_seconds=15)
    fits = [p for p in result.points if p.epoch_seconds <= 15]
    assert result.batch_size == min(p.batch_size for p in fits)
    assert result.point(result.batch_size).epoch_seconds == pytest.approx(
        math.ceil(100_000 / result.batch_size) * (ALPHA + BETA * result.batch_size)
    )
    impossible = optimal(max_batch_size=64, dataset_size=100_000, time_budget_seconds=1)
    assert "no batch size meets the 1 s epoch budget" in impossible.notes[0]


def test_tokens_per_second_when_the_sequence_length_is_known():
    result = optimal(max_batch_size=64, tokens_per_sample=128)
    assert all(p.tokens_per_second == pytest.approx(128 * p.samples_per_second) for p in result.points)


def test_without_a_maximum_it_finds_one_first_on_a_real_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = (torch.randn(4, 16), torch.randint(0, 4, (4,)))
    result = find_optimal_batch_size(
        model, batch, loss_fn=torch.nn.functional.cross_entropy, device="sim:96KiB", timed_steps=1
    )
    assert result.largest_batch_size == max(p.batch_size for p in result.points) > 1
    assert 1 <= result.batch_size <= result.largest_batch_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tolerance": 1.5}, "tolerance must be in"),
        ({"safety_fraction": 0}, "safety_fraction must be in"),
        ({"timed_steps": 0}, "timed_steps >= 1"),
        ({"time_budget_seconds": 10}, "a time budget needs dataset_size"),
    ],
)
def test_bad_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        optimal(max_batch_size=16, **kwargs)


def test_timing_warmup_steps_run_untimed_before_the_timed_steps():
    model, batch, _, clock = timed_workload()
    calls: dict[int, int] = {}

    def counting_step(model, batch):
        calls[batch.shape[0]] = calls.get(batch.shape[0], 0) + 1
        clock.now += ALPHA + BETA * batch.shape[0]
        return model(batch).mean()

    find_optimal_batch_size(
        model,
        batch,
        step_fn=counting_step,
        device="sim:64MiB",
        clock=clock,
        max_batch_size=8,
        timing_warmup_steps=3,
        timed_steps=2,
    )
    assert {1, 2, 4, 8} <= set(calls) and set(calls.values()) == {5}  # 3 untimed + 2 timed per size
    with pytest.raises(ValueError, match="need timing_warmup_steps >= 0"):
        optimal(max_batch_size=8, timing_warmup_steps=-1)


def test_the_search_for_the_maximum_gets_every_search_keyword(monkeypatch):
    import batchfit.throughput.optimal as throughput

    seen = []

    def fake_search(workload, settings=None, *, device=None, **options):
        seen.append((settings, options))
        return type("Found", (), {"batch_size": 16})()

    monkeypatch.setattr(throughput, "search_workload", fake_search)
    result = optimal(min_batch_size=3, strategy="binary", margin="1MiB", trace=False, cache=False)
    ((settings, options),) = seen
    assert options == {} and (settings.min_batch_size, settings.strategy, settings.margin, settings.trace) == (
        3,
        "binary",
        "1MiB",
        False,
    )
    assert result.largest_batch_size == 16 and min(p.batch_size for p in result.points) == 3


def test_a_margin_is_kept_free_while_timing_too():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = (torch.randn(4, 16), torch.randint(0, 4, (4,)))
    loss = torch.nn.functional.cross_entropy
    kept = find_optimal_batch_size(model, batch, loss_fn=loss, device="sim:96KiB", timed_steps=1, margin=0.5)
    full = find_optimal_batch_size(model, batch, loss_fn=loss, device="sim:96KiB", timed_steps=1)
    assert kept.largest_batch_size < full.largest_batch_size
    too_big = find_optimal_batch_size(
        model,
        batch,
        loss_fn=loss,
        device="sim:96KiB",
        timed_steps=1,
        margin=0.5,
        max_batch_size=full.largest_batch_size,
    )
    assert max(p.batch_size for p in too_big.points) < full.largest_batch_size  # the largest no longer fits the margin


class TimelineDevice(SimulatedDevice):
    """A simulated device with CUDA's ``record_timeline`` switch."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.record_timeline = True


def test_the_callers_device_is_left_exactly_as_it_was():
    device = TimelineDevice("64MiB")
    model, batch, step_fn, clock = timed_workload()
    find_optimal_batch_size(model, batch, step_fn=step_fn, device=device, clock=clock, max_batch_size=8)
    assert device.record_timeline is True

    def failing_step(model, batch):
        raise RuntimeError("a bug in the step")

    with pytest.raises(RuntimeError, match="a bug in the step"):
        find_optimal_batch_size(model, batch, step_fn=failing_step, device=device, max_batch_size=8)
    assert device.record_timeline is True


def test_the_result_is_a_sentence_and_a_json_ready_dict():
    result = optimal(max_batch_size=16)
    document = json.loads(json.dumps(result.to_dict()))
    assert document["batch_size"] == result.batch_size and len(document["points"]) == len(result.points)
    assert result.summary().startswith(f"Use batch size {result.batch_size}:") and result.summary().count(". ") <= 1


def test_the_old_warmup_steps_keyword_still_works_for_one_release_and_warns():
    model, batch, _, clock = timed_workload()
    calls: dict[int, int] = {}

    def counting_step(model, batch):
        calls[batch.shape[0]] = calls.get(batch.shape[0], 0) + 1
        clock.now += ALPHA + BETA * batch.shape[0]
        return model(batch).mean()

    with pytest.warns(DeprecationWarning, match="timing_warmup_steps"):
        find_optimal_batch_size(
            model,
            batch,
            step_fn=counting_step,
            device="sim:64MiB",
            clock=clock,
            max_batch_size=4,
            warmup_steps=3,
            timed_steps=2,
        )
    assert set(calls.values()) == {5}  # the old keyword still sets the untimed steps: 3 + 2 per size


def test_the_largest_size_timed_is_largest_batch_size_and_the_old_name_warns():
    result = optimal(max_batch_size=16)
    assert result.largest_batch_size == 16 and result.to_dict()["largest_batch_size"] == 16
    with pytest.warns(DeprecationWarning, match="largest_batch_size"):
        assert result.max_batch_size == 16
