"""The default search spends the cheaper evidence first: the trace where a real trial is expensive,
real trials where they cost less than the trace would, deciding from what it measures."""

from __future__ import annotations

import pytest

import batchfit as bf
from batchfit.search import evidence
from batchfit.search.trial import Trial
from models import CASES


def first_trial(seconds: float, ops: int) -> Trial:
    return Trial(1, True, 4096, seconds, steps=2, timeline=tuple(range(2 * ops)))


@pytest.mark.parametrize(
    ("seconds", "ops", "warm", "trace_first", "says"),
    [
        (5.0, 2000, True, True, "would cost less than the real trial at 1"),  # an expensive trial
        (0.1, 200, True, True, "would cost less"),  # 0.08 s of fake ops against a 100 ms trial
        (0.01, 2000, True, False, "would cost more"),  # 0.8 s of fake ops against a 10 ms trial
        (0.01, 200, False, False, "would cost more"),  # the fake mode's start-up is not paid yet
    ],
)
def test_after_the_first_trial_the_predicted_costs_decide(monkeypatch, seconds, ops, warm, trace_first, says):
    monkeypatch.setattr(evidence, "fake_mode_warm", lambda: warm)
    choice = evidence.after_first_trial(first_trial(seconds, ops))
    assert choice.trace_first is trace_first and says in choice.reason
    expected = evidence.TRACE_FAKE_TRIALS * 2 * ops * evidence.FAKE_OP_SECONDS + (0 if warm else 0.7)
    assert choice.predicted_trace_seconds == pytest.approx(expected)


def test_a_device_that_says_steps_are_expensive_traces_before_any_real_trial():
    case = CASES[0]
    result = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity, step_seconds=0.05))
    assert result.extra["evidence"]["trace_first"] and "costs 0.05 s" in result.extra["evidence"]["reason"]
    assert [t.batch_size for t in result.trials] == [result.batch_size, result.batch_size + 1]
    assert "; traced: each training step" in result.summary()


def test_cheap_trials_measure_first_and_the_answer_is_the_same_either_way(monkeypatch):
    case = CASES[0]
    monkeypatch.setattr(evidence, "FAKE_OP_SECONDS", 1.0)  # a trace that could never pay
    untraced = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity))
    assert not untraced.extra["evidence"]["trace_first"] and "trace" not in untraced.extra
    assert untraced.trials[0].batch_size == 2 and "; no trace: " in untraced.summary()
    monkeypatch.setattr(evidence, "FAKE_OP_SECONDS", 0.0)  # a trace that costs nothing: it goes next
    monkeypatch.setattr(evidence, "fake_mode_warm", lambda: True)
    traced = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity))
    assert traced.extra["evidence"]["trace_first"] and traced.extra["trace"]["batch_size"] == traced.batch_size
    assert [t.batch_size for t in traced.trials] == [2, traced.batch_size, traced.batch_size + 1]
    assert traced.batch_size == untraced.batch_size


def test_trace_true_and_false_force_the_choice():
    case = CASES[1]
    forced = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), trace=True)
    assert forced.extra["evidence"]["reason"] == "trace=True asks for the trace first" and len(forced.trials) == 2
    never = bf.search_workload(case.build(), device=bf.SimulatedDevice(case.capacity), trace=False)
    assert "evidence" not in never.extra and "trace" not in never.extra
    assert never.batch_size == forced.batch_size
    with pytest.raises(TypeError, match="trace must be 'auto', True or False"):
        bf.SearchSettings(trace="sometimes")


def test_a_first_trial_out_of_memory_is_said_in_plain_words_and_nothing_is_traced():
    """The first size tried does not fit: every size left is smaller, so the search measures them and
    does not trace; the answer says so without the search's own vocabulary."""
    from batchfit.step.builtin_workloads import gpt_tiny

    result = bf.search_workload(gpt_tiny(), device=bf.SimulatedDevice("9MiB"))  # 2 is out of memory, 1 fits
    assert [(t.batch_size, t.fits) for t in result.trials] == [(2, False), (1, True)]
    assert not result.extra["evidence"]["trace_first"] and "trace" not in result.extra
    assert result.summary().endswith(
        "; no trace: batch size 2, the first size tried, ran out of memory, so batchfit measured the smaller sizes"
        " directly and skipped the estimate on fake tensors (it only helps above a size that fits)."
    )


def test_a_device_that_records_no_memory_per_operation_traces_first_and_says_why_plainly():
    choice = evidence.after_first_trial(Trial(2, True, 4096, 0.01, steps=2, timeline=None))
    assert choice.trace_first
    assert choice.reason == (
        "this device does not record its memory operation by operation, so batchfit cannot tell whether an estimate"
        " on fake tensors would be quicker than more real trials: it ran the estimate first (trace=False or"
        " --no-trace skips it)"
    )
