"""What the engines' tests compare: a job's outcome from an engine against ``run_job``'s in this process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import Outcome


def without_timings(value: Any) -> Any:
    """``value`` less what differs from run to run: every ``*seconds`` entry, at any depth."""
    if isinstance(value, Mapping):
        return {key: without_timings(item) for key, item in value.items() if not str(key).endswith("seconds")}
    if isinstance(value, list | tuple):
        return [without_timings(item) for item in value]
    return value


def assert_same_outcome(got: Outcome | Death, expected: Outcome) -> None:
    """Field by field, except timings, the process id and the host."""
    assert isinstance(got, Outcome), got
    assert got.knobs == expected.knobs
    assert without_timings(got.record) == without_timings(expected.record)
    assert got.pending == expected.pending
    assert got.log == expected.log
