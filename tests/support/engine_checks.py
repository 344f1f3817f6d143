"""What the engines' tests compare (a job's outcome from an engine against ``run_job``'s in this process), and an engine
that runs its jobs in this process, for the driver's logic."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from batchfit.sweep.engines.base import Handle
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import Outcome
from batchfit.sweep.jobs import run_job


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


class InProcessEngine:
    """The driver's logic without processes: each job sent runs in this process when ``poll`` reaches it, one a
    call in the order sent; a job whose label is in ``dies`` ends as a ``Death`` the first time it is sent. The
    engines that start processes are tested with real ones (tests/sweep/test_sweep_engines.py, slow)."""

    name = "in-process"

    def __init__(self, slots: int = 2, dies: tuple[str, ...] = ()):
        self.labels = [f"slot {n}" for n in range(1, slots + 1)]
        self.free = list(self.labels)
        self.dies = set(dies)

    def slots(self) -> list[str]:
        return list(self.labels)

    def room(self, running: int) -> int:
        return len(self.free)

    def submit(self, jobs: Sequence[ConfigJob]) -> list[Handle]:
        return [Handle(job, self.free.pop(0)) for job in jobs]

    def poll(self, handles: Sequence[Handle], timeout_s: float) -> list[tuple[Handle, Outcome | Death]]:
        if not handles:
            return []
        handle = handles[0]
        self.free.append(handle.slot)
        if handle.job.label in self.dies and handle.job.attempt == 1:
            return [(handle, Death("killed by SIGKILL (the host's out-of-memory killer, or a kill)"))]
        return [(handle, run_job(handle.job))]

    def reattach(self, job: ConfigJob, token: str) -> Handle | None:
        return None

    def close(self) -> None:
        return None
