"""The edge from lines through two trials (``MemoryModel.between``) and the trace strategy built on it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from batchfit.search.memory_model import MemoryModel
from batchfit.search.phase_lines import PhaseLines
from batchfit.search.strategies import SearchSpace
from batchfit.search.trial import Trial

Phases = Callable[[int], dict[str, int]]


def _traced(batch_size: int, phases: dict[str, int], limit_bytes: int) -> Trial:
    """A trial as a trace reports it: its peak by phase, also past the memory."""
    peak = max(phases.values())
    return Trial(batch_size, peak <= limit_bytes, peak, 0.0, phase_peak_bytes=phases)


def _search(phases: Phases, limit_bytes: int, max_batch_size: int = 10_000) -> list[Trial]:
    space, strategy, trials = SearchSpace(1, max_batch_size, limit_bytes), PhaseLines(), []
    while (size := strategy.next(trials, space)) is not None:
        assert size not in {t.batch_size for t in trials}, f"{size} proposed twice"
        trials.append(_traced(size, phases(size), limit_bytes))
    return trials


def test_lines_between_two_trials_reach_the_limit_exact_to_the_byte() -> None:
    # 8,560,921,406 bytes over 7 sizes is no whole number of bytes per size: a float slope puts this edge
    # one size low, as (limit - low) / (rise / 7) rounds just under 1827.
    low_bytes, rise = 10**9, 8_560_921_406
    limit = low_bytes + 2_234_400_486_966
    model = MemoryModel.between(Trial(2, True, low_bytes, 0.0), Trial(9, False, low_bytes + rise, 0.0))
    edge = model.max_batch_size(limit)
    assert model.kind == "between"
    assert 7 * (limit - low_bytes) >= rise * (edge - 2)  # the line at the edge is within the limit ...
    assert 7 * (limit - low_bytes) < rise * (edge + 1 - 2)  # ... and one more is past it
    assert edge == 1829


def test_lines_between_two_trials_follow_each_phase_both_report() -> None:
    low = Trial(1, True, 2001, 0.0, phase_peak_bytes={"forward": 130, "backward": 550, "optimizer": 2001})
    high = Trial(2, True, 2002, 0.0, phase_peak_bytes={"forward": 160, "backward": 600, "optimizer": 2002})
    model = MemoryModel.between(low, high)
    # backward's line (500 + 50 B) reaches 5000 at 90; the optimizer's (2000 + B) only at 3000.
    assert model.max_batch_size(5000) == 90
    assert model.predict_peak_bytes(90) == 5000.0
    assert MemoryModel.between(low, Trial(3, False, None, 0.0)) is None  # an OOM without a peak draws no line
    assert MemoryModel.between(low, low) is None


def test_phase_lines_on_a_line_trace_1_2_the_edge_and_one_more() -> None:
    trials = _search(lambda b: {"backward": 1000 + 37 * b}, 3000)
    # the line through 1 and 2 reaches 3000 at 1 + (3000 - 1037) // 37 = 54
    assert [t.batch_size for t in trials] == [1, 2, 54, 55]
    assert [t.fits for t in trials] == [True, True, True, False]


def test_phase_lines_aim_from_the_failing_trace_on_a_curved_peak() -> None:
    # 1000 + 3 B^2: the line through 1 and 2 overshoots to 222; the line from 2 to the failed trace at 222
    # (whose peak a trace still knows) aims back near the edge, and the bracket closes on 25 next to 26.
    limit = 3000
    trials = _search(lambda b: {"backward": 1000 + 3 * b * b}, limit)
    sizes = [t.batch_size for t in trials]
    truth = max(b for b in range(1, 100) if 1000 + 3 * b * b <= limit)
    assert sizes[:4] == [1, 2, 222, 4]  # 1 + 1997 // 9 = 222; then 2 + 1988 * 220 // 147840 = 4
    fitting = max(t.batch_size for t in trials if t.fits)
    assert fitting == truth == 25 and truth + 1 in sizes and not next(t for t in trials if t.batch_size == 26).fits
    assert len(trials) <= 16  # the lines creep up a curve; past two traces on one side the bracket halves


@pytest.mark.parametrize("limit_bytes", [1500, 2999, 3000, 7777])
def test_phase_lines_end_on_a_fitting_trace_next_to_a_failing_one(limit_bytes: int) -> None:
    def phases(b: int) -> dict[str, int]:  # the optimizer peaks first, backward overtakes it
        return {"forward": 100 + 30 * b, "backward": 500 + 50 * b, "optimizer": 2000 + b}

    trials = _search(phases, limit_bytes)
    truth = max((b for b in range(1, 10_000) if max(phases(b).values()) <= limit_bytes), default=0)
    best = max((t.batch_size for t in trials if t.fits), default=0)
    assert best == truth
    if truth:
        assert any(t.batch_size == truth + 1 and not t.fits for t in trials)


def test_phase_lines_stop_at_the_maximum_and_when_the_first_size_fails() -> None:
    assert [t.batch_size for t in _search(lambda b: {"backward": 10 * b}, 10**9, max_batch_size=64)] == [1, 2, 64]
    assert [t.batch_size for t in _search(lambda b: {"backward": 5000 + b}, 3000)] == [1]
