"""find_optimal_batch_size when timings are noisy: a fake clock whose steps take seeded random times says
whether the sizes can be told apart, extra steps are timed before giving up, a time limit cuts the timing
short, and a callback hears of each size as it is timed."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.throughput import find_optimal_batch_size
from batchfit.throughput import optimal_for_workload

ALPHA, BETA = 0.01, 1e-4  # seconds, seconds per sample
WARMUP, TIMED = 2, 5  # the defaults: untimed and timed steps per size


class StepClock:
    """A clock that moves only when a step runs, by ``duration(batch_size, rng)`` seconds; it counts the steps
    run at each size, in the order the sizes ran."""

    def __init__(self, duration, seed: int = 0):
        self.now, self.duration, self.rng = 0.0, duration, random.Random(seed)
        self.steps: dict[int, int] = {}
        self.order: list[int] = []

    def __call__(self) -> float:
        return self.now

    def step_fn(self, model, batch):
        size = batch.shape[0]
        self.steps[size] = self.steps.get(size, 0) + 1
        if not self.order or self.order[-1] != size:
            self.order.append(size)
        self.now += self.duration(size, self.rng)
        return model(batch).mean()


def optimal(clock: StepClock, **kwargs):
    return find_optimal_batch_size(
        torch.nn.Linear(4, 1), torch.randn(2, 4), step_fn=clock.step_fn, device="sim:64MiB", clock=clock, **kwargs
    )


def cpu_bound(size: int, rng: random.Random) -> float:
    """A tiny model on a CPU: every sample costs the same, there is no fixed cost to amortise, and each step's
    time wanders by about 20% (seeded): throughput does not depend on the batch size."""
    return 1e-3 * size * rng.lognormvariate(0, 0.2)


def fixed_and_per_sample(size: int, rng: random.Random) -> float:
    """A real fixed cost and a per-sample cost, t = alpha + beta*B, with about 1% noise."""
    return (ALPHA + BETA * size) * rng.lognormvariate(0, 0.01)


def falling(size: int, rng: random.Random) -> float:
    """A step that gets faster as the batch grows (as warm-up or contention at the first sizes would make it)."""
    return (0.1 - 1e-3 * size) * rng.lognormvariate(0, 0.01)


@pytest.mark.parametrize("seed", range(4))
def test_a_cpu_bound_model_whose_throughput_ignores_the_batch_is_called_indistinguishable(seed):
    clock = StepClock(cpu_bound, seed)
    result = optimal(clock, max_batch_size=64)
    sizes = [p.batch_size for p in result.points]
    assert not result.distinguishable
    assert f"every size from {sizes[0]} to {sizes[-1]} runs within the timing noise of the best" in result.verdict
    assert "Use batch size" not in result.summary()
    assert result.summary().startswith("The timings cannot tell these sizes apart on this device")
    assert result.knee(0.9) is None and result.no_knee_reason is not None
    # every size ran within the noise of the best, so the size given is the smallest measured, and the summary says by what rule
    assert result.batch_size == sizes[0] and "smallest batch within the timing noise" in result.summary()


def test_before_giving_up_it_times_the_sizes_again_with_more_steps():
    clock = StepClock(cpu_bound, seed=1)
    result = optimal(clock, max_batch_size=64, extra_timed_steps=7)
    retimed = [p for p in result.points if len(p.timed_step_seconds) > TIMED]
    assert retimed, "no size was timed again"
    for point in retimed:
        assert len(point.timed_step_seconds) == TIMED + 7
        assert clock.steps[point.batch_size] == 2 * WARMUP + TIMED + 7  # a second trial: its own warm-up, then 7 more
    assert any(note.startswith(f"timed {len(retimed)} sizes again") for note in result.notes)
    never = optimal(StepClock(cpu_bound, seed=1), max_batch_size=64, extra_timed_steps=0)
    assert all(len(p.timed_step_seconds) == TIMED for p in never.points)


def test_each_point_keeps_the_spread_of_its_timed_steps():
    result = optimal(StepClock(cpu_bound, seed=2), max_batch_size=16, extra_timed_steps=0)
    for point in result.points:
        timed = sorted(point.timed_step_seconds)
        assert len(timed) == TIMED and point.step_seconds == timed[TIMED // 2]  # the median of the timed steps
        assert timed[0] <= point.step_seconds_low <= point.step_seconds <= point.step_seconds_high <= timed[-1]
        assert point.samples_per_second_low <= point.samples_per_second <= point.samples_per_second_high
    document = json.loads(json.dumps(result.to_dict()))
    assert document["distinguishable"] is result.distinguishable and document["verdict"] == result.verdict
    assert len(document["points"][0]["timed_step_seconds"]) == TIMED
    assert document["points"][0]["step_seconds_low"] == result.points[0].step_seconds_low


@pytest.mark.parametrize("seed", range(4))
def test_a_real_fixed_and_per_sample_cost_still_names_the_knee(seed):
    result = optimal(StepClock(fixed_and_per_sample, seed), max_batch_size=1024)
    assert result.distinguishable and "the timings tell the sizes apart" in result.verdict
    assert result.knee(0.90) == pytest.approx(9 * ALPHA / BETA, rel=0.05)
    assert result.summary().startswith(f"Use batch size {result.batch_size}:")
    best = result.point(result.best_batch_size).samples_per_second
    assert result.point(result.batch_size).samples_per_second >= 0.95 * best  # the tolerance rule, as before
    assert all(p.samples_per_second < 0.95 * best for p in result.points if p.batch_size < result.batch_size)


def test_a_step_that_gets_faster_with_the_batch_has_no_knee_and_is_flagged():
    clock = StepClock(falling, seed=0)
    result = optimal(clock, max_batch_size=64)
    assert result.beta_seconds_per_sample < 0
    assert result.knee(0.90) is None and result.knee(0.95) is None
    assert "negative" in result.no_knee_reason and "fixed cost" not in result.no_knee_reason
    assert any("the fitted per-sample cost is negative" in note for note in result.notes)
    assert not result.distinguishable and "the step time fell as the batch grew" in result.verdict
    assert "Use batch size" not in result.summary()
    assert all(clock.steps[p.batch_size] > WARMUP + TIMED for p in result.points)  # every size was timed again
    document = result.to_dict()
    assert document["knee_90"] is None and document["no_knee_reason"] == result.no_knee_reason


def test_a_time_limit_starts_no_new_size_once_passed_and_says_so():
    def slow(size: int, rng: random.Random) -> float:
        return 1.0 + 0.01 * size  # seconds a step: 7 steps a size, so about 7 s a size

    unlimited = optimal(StepClock(slow), max_batch_size=1024)
    clock = StepClock(slow)
    result = optimal(clock, max_batch_size=1024, max_seconds=10)
    assert len(result.points) < len(unlimited.points)
    assert set(clock.steps) == {p.batch_size for p in result.points}  # no size started that was not kept
    last = clock.order[-1]
    assert clock.now - (WARMUP + TIMED) * slow(last, None) < 10 <= clock.now  # the last size began in time
    assert result.stopped_by == "max_seconds" and unlimited.stopped_by is None
    assert any("s limit (max_seconds) cut the timing short" in note for note in result.notes)
    assert 1 <= result.batch_size <= max(p.batch_size for p in result.points)


def test_the_first_size_is_timed_even_when_the_limit_is_tiny():
    clock = StepClock(lambda size, rng: 5.0)
    result = optimal(clock, max_batch_size=64, max_seconds=1e-9)
    assert [p.batch_size for p in result.points] == [1] and result.stopped_by == "max_seconds"


def test_the_time_limit_also_bounds_the_search_for_the_largest_size(monkeypatch):
    import batchfit.throughput.optimal as throughput

    seen = []

    def fake_search(workload, settings=None, *, device=None, **options):
        seen.append(settings.max_seconds)
        return type("Found", (), {"batch_size": 16, "extra": {"stopped_by": "max_seconds"}})()

    monkeypatch.setattr(throughput, "search_workload", fake_search)
    result = optimal(StepClock(fixed_and_per_sample), max_seconds=30)
    assert seen == [30] and result.largest_batch_size == 16 and result.stopped_by == "max_seconds"
    assert any("the search for the largest batch stopped early (max_seconds) at 16" in note for note in result.notes)


@pytest.mark.parametrize(
    ("max_seconds", "error", "message"),
    [
        (0, InputError, "max_seconds must be above 0"),
        (-1, InputError, "max_seconds must be above 0"),
        (math.nan, InputError, "max_seconds must be above 0"),
        (math.inf, InputError, "max_seconds must be a finite number"),
        ("x", InputTypeError, "max_seconds must be a number of seconds"),
        (True, InputTypeError, "max_seconds must be a number of seconds"),
    ],
)
def test_a_bad_time_limit_is_refused_before_any_step(max_seconds, error, message):
    clock = StepClock(fixed_and_per_sample)
    with pytest.raises(error, match=message) as caught:
        optimal(clock, max_batch_size=16, max_seconds=max_seconds)
    assert "\n" not in str(caught.value) and clock.steps == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"on_point": "print"}, InputTypeError, "on_point must be a function"),
        ({"extra_timed_steps": -1}, InputError, "extra_timed_steps must be a whole number"),
        ({"extra_timed_steps": 2.5}, InputError, "extra_timed_steps must be a whole number"),
    ],
)
def test_bad_noise_options_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        optimal(StepClock(fixed_and_per_sample), max_batch_size=16, **kwargs)


def test_the_progress_callback_hears_of_each_size_as_it_is_timed():
    clock = StepClock(lambda size, rng: ALPHA + BETA * size)  # exact: no size is timed again
    heard = []

    def on_point(point):
        assert clock.order[-1] == point.batch_size  # called right after that size ran, before the next
        heard.append(point)

    result = optimal(clock, max_batch_size=256, on_point=on_point)
    assert [p.batch_size for p in heard] == clock.order  # once per size, in the order they were timed
    assert sorted(heard, key=lambda p: p.batch_size) == result.points


def test_optimal_for_workload_takes_the_same_new_keywords():
    from batchfit.step.workload import Workload

    clock = StepClock(lambda size, rng: 2.0)
    heard = []
    workload = Workload(torch.nn.Linear(4, 1), torch.randn(2, 4), step_fn=clock.step_fn)
    result = optimal_for_workload(
        workload,
        device="sim:64MiB",
        max_batch_size=64,
        clock=clock,
        on_point=heard.append,
        max_seconds=20,
        extra_timed_steps=0,
    )
    assert [p.batch_size for p in heard] == [p.batch_size for p in result.points] == [1, 2]  # 14 s a size
    assert result.stopped_by == "max_seconds"
