"""Strategies against plain fits(b) functions: exact sequences of sizes tried, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from batchfit.search.strategies import STRATEGIES
from batchfit.search.strategies import Auto
from batchfit.search.strategies import Binary
from batchfit.search.strategies import Grow
from batchfit.search.strategies import Halving
from batchfit.search.strategies import Power
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import make_strategy
from strategy_harness import linear_peak
from strategy_harness import run_strategy


def below(edge: int):
    return lambda b: b <= edge


def test_binary_follows_the_classic_bisection():
    # the classic binary search: low=1, high=512, mid=(low+high)//2; fits -> low=mid+1, OOM -> high=mid-1
    sizes, answer = run_strategy(Binary(), SearchSpace(1, 512), below(100))
    assert sizes == [256, 128, 64, 96, 112, 104, 100, 102, 101]
    assert answer == 100


def test_power_doubles_then_bisects_like_lightning_binsearch():
    sizes, answer = run_strategy(Power(), SearchSpace(1, 1024), below(100))
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 128, 96, 112, 104, 100, 102, 101]
    assert answer == 100


def test_grow_from_an_estimate_below_the_edge_grows_by_half_to_the_cap():
    sizes, answer = run_strategy(Grow(start=19), SearchSpace(1, 64), below(64))
    assert sizes == [19, 28, 42, 63, 64]
    assert answer == 64


def test_grow_from_an_estimate_above_the_edge_halves_then_bisects():
    sizes, answer = run_strategy(Grow(start=19), SearchSpace(1, 64), below(16))
    assert sizes[:4] == [19, 9, 14, 16]  # halve, then bisect between 9 and 19
    assert sizes == [19, 9, 14, 16, 17]
    assert answer == 16


def test_grow_past_the_edge_bisects_after_the_first_failure():
    sizes, answer = run_strategy(Grow(start=19), SearchSpace(1, 64), below(24))
    assert sizes[:3] == [19, 28, 23]  # x1.5 once, then bisect between 19 and 28
    assert sizes == [19, 28, 23, 25, 24]
    assert answer == 24


def test_halving_backs_off_from_the_top_then_bisects_up():
    sizes, answer = run_strategy(Halving(), SearchSpace(1, 128), below(40))
    assert sizes == [128, 64, 32, 48, 40, 44, 42, 41]
    assert answer == 40


def test_auto_jumps_to_the_edge_of_a_linear_memory_and_verifies_it():
    space = SearchSpace(1, 10_000, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)  # edge: (1e6 - 1e5) / 3e3 = 300
    # Unknown held bytes: the one-point line treats all 103 kB at b=1 as per-sample (safe), so the
    # second probe is 9; the two-point line then lands on the edge.
    sizes, answer = run_strategy(Auto(), space, lambda b: peak(b) <= 1_000_000, peak)
    assert sizes == [1, 9, 300, 301]
    assert answer == 300
    # Known held bytes (what a device reports): the one-point line is already exact.
    sizes, answer = run_strategy(Auto(), space, lambda b: peak(b) <= 1_000_000, peak, held_bytes=100_000)
    assert sizes == [1, 300, 301]


def test_auto_stops_at_the_cap_when_the_cap_fits():
    space = SearchSpace(1, 50, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)
    sizes, answer = run_strategy(Auto(), space, lambda b: peak(b) <= 1_000_000, peak, held_bytes=100_000)
    assert sizes == [1, 50]
    assert answer == 50


def test_auto_falls_back_to_bisection_when_memory_is_not_linear():
    space = SearchSpace(1, 4096, limit_bytes=10**9)
    peak = lambda b: 1_000 * b**2  # noqa: E731  quadratic: every linear jump overshoots
    sizes, answer = run_strategy(Auto(), space, lambda b: peak(b) <= 10**9, peak)
    assert answer == 1000
    assert len(sizes) <= 20


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_nothing_fits_gives_no_answer(name):
    sizes, answer = run_strategy(make_strategy(name), SearchSpace(1, 64, 1000), lambda b: False, lambda b: 10**6)
    assert answer is None
    assert 1 in sizes


def test_make_strategy_rejects_unknown_names_and_objects():
    with pytest.raises(ValueError, match=r"unknown strategy 'fastest'.*auto"):
        make_strategy("fastest")
    with pytest.raises(TypeError, match="next"):
        make_strategy(42)
    with pytest.raises(ValueError, match="factor"):
        Grow(factor=1.0)


@st.composite
def search_problems(draw):
    low = draw(st.integers(1, 50))
    high = draw(st.integers(low, 3000))
    edge = draw(st.one_of(st.integers(0, low - 1), st.integers(low, high), st.just(high), st.integers(high, 5000)))
    base = draw(st.integers(0, 10**6))
    per_sample = draw(st.integers(1, 10**5))
    return low, high, edge, base, per_sample


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@settings(max_examples=150, deadline=None)
@given(problem=search_problems())
def test_every_strategy_finds_the_true_edge_and_only_returns_tested_sizes(name, problem):
    low, high, edge, base, per_sample = problem
    limit = base + per_sample * edge  # memory is linear and the threshold is exactly at `edge`
    peak = linear_peak(base, per_sample)
    sizes, answer = run_strategy(make_strategy(name), SearchSpace(low, high, limit), below(edge), peak)
    truth = min(edge, high) if edge >= low else None
    assert answer == truth
    if answer is not None:
        assert answer in sizes
        assert answer == high or answer + 1 in sizes  # the edge is confirmed, not assumed


@settings(max_examples=150, deadline=None)
@given(problem=search_problems(), bumps=st.lists(st.integers(0, 5000), max_size=8))
def test_auto_finds_the_edge_when_the_memory_model_is_wrong(problem, bumps):
    low, high, edge, base, per_sample = problem
    # Peaks that are not linear (allocator steps at arbitrary sizes); the fits oracle is monotone.
    peak = lambda b: base + per_sample * b + sum(50_000 for bump in bumps if b >= bump)  # noqa: E731
    limit = peak(edge) if edge >= 0 else 0
    fits = lambda b: peak(b) <= limit  # noqa: E731
    _sizes, answer = run_strategy(Auto(), SearchSpace(low, high, limit), fits, peak)
    truth = max((b for b in range(low, high + 1) if fits(b)), default=None)
    assert answer == truth


def test_auto_with_a_right_guess_needs_only_the_edge_and_one_more():
    space = SearchSpace(1, 10_000, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)
    sizes, answer = run_strategy(Auto(guess=300), space, lambda b: peak(b) <= 1_000_000, peak)
    assert sizes == [300, 301] and answer == 300


def test_auto_steps_down_from_a_guess_that_was_too_high():
    space = SearchSpace(1, 10_000, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)
    sizes, answer = run_strategy(Auto(guess=330), space, lambda b: peak(b) <= 1_000_000, peak, held_bytes=100_000)
    assert sizes[:2] == [330, 313]  # 5% below the failed guess
    assert answer == 300 and len(sizes) <= 5


def test_auto_measures_the_minimum_when_a_guess_is_far_too_high():
    space = SearchSpace(1, 10_000, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)
    sizes, answer = run_strategy(Auto(guess=2400), space, lambda b: peak(b) <= 1_000_000, peak, held_bytes=100_000)
    assert sizes == [2400, 2280, 1, 300, 301]  # 8x too high: one step down, then the model aims from the minimum
    assert answer == 300


def test_auto_climbs_from_a_guess_that_was_too_low():
    space = SearchSpace(1, 10_000, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)
    sizes, answer = run_strategy(Auto(guess=280), space, lambda b: peak(b) <= 1_000_000, peak, held_bytes=100_000)
    assert sizes[:2] == [280, 281]
    assert answer == 300 and len(sizes) <= 5


@settings(max_examples=150, deadline=None)
@given(problem=search_problems(), guess=st.integers(1, 6000))
def test_auto_finds_the_true_edge_from_any_guess(problem, guess):
    low, high, edge, base, per_sample = problem
    limit = base + per_sample * edge
    _sizes, answer = run_strategy(
        Auto(guess=guess), SearchSpace(low, high, limit), below(edge), linear_peak(base, per_sample)
    )
    assert answer == (min(edge, high) if edge >= low else None)


def test_a_failed_guess_does_not_use_up_the_trials_before_bisection():
    space = SearchSpace(1, 10_000, limit_bytes=1_000_000)
    peak = linear_peak(100_000, 3_000)
    sizes, answer = run_strategy(
        Auto(guess=2400, bisect_after=4), space, lambda b: peak(b) <= 1_000_000, peak, held_bytes=100_000
    )
    assert sizes == [2400, 2280, 1, 300, 301]  # 5 trials, past bisect_after=4, yet the model still aims
    assert answer == 300


def test_auto_gallops_up_where_its_model_keeps_undershooting():
    # Memory that grows slower than any line through the trials: each aim fits. Past bisect_after
    # aims, auto steps 2%, 4%, 8%, ... above the last fit until a size fails (it doubled, 2x past the edge).
    space = SearchSpace(1, 100_000, limit_bytes=447_214)
    peak = lambda b: int(10_000 * b**0.5)  # noqa: E731
    sizes, answer = run_strategy(Auto(), space, lambda b: peak(b) <= 447_214, peak)
    assert sizes[:9] == [1, 44, 334, 889, 1379, 1683, 1716, 1784, 1926]  # the model's aims, then 2%, 4%, 8%
    assert answer == 2000 and max(sizes) < 1.2 * 2000 and len(sizes) == 18
