"""Slurm's states of a sweep's array tasks, asked in one call for many tasks and not too often (``SlurmStates``),
and the one line that says how a task ended without a result (``death_reason``). States from Slurm's ``squeue``
manual ("JOB STATE CODES"); accounting through submitit's watcher (``submitit/slurm/slurm.py``)."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Iterable
from collections.abc import Sequence

try:  # noqa: SIM105 (the dependency check reads an ImportError guard)
    from submitit.slurm.slurm import SlurmJob
except ImportError:  # the extra is missing: make_engine names it before this module is used
    pass

STATE_INTERVAL_S = 15.0  # at most one squeue (or sacct) call per this many seconds while tasks run
GONE = "GONE"  # neither squeue nor accounting knows the task any more
# Slurm's states of a job that ended (squeue(1), "JOB STATE CODES"); any other state is queued or running
ENDED_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
    | {"REVOKED", "SPECIAL_EXIT", "TIMEOUT", GONE}
)
WHY = {
    "FAILED": "its process failed or was killed",
    "OUT_OF_MEMORY": "Slurm killed it over its host memory limit (not a device out-of-memory bound)",
    "TIMEOUT": "it ran past its time limit of {time_min} min",
    "CANCELLED": "it was cancelled",
    "NODE_FAIL": "its node failed",
    "BOOT_FAIL": "its node failed to boot",
    "PREEMPTED": "it was preempted",
    "DEADLINE": "it reached its deadline",
    "COMPLETED": "it completed without a result file: is the folder on a file system the nodes share?",
    GONE: "Slurm no longer knows it",
}


class SlurmStates:
    """Tasks' states, asked of Slurm for many tasks in one call, and at most once per ``interval_s``:
    ``squeue`` for what the controller holds (queued, running, and ended within its ``MinJobAge``), else
    accounting (``sacct``, through submitit's watcher and its cache). A task that neither knows is ``GONE``,
    but only after ``squeue`` answered: a controller that does not answer changes nothing."""

    def __init__(self, interval_s: float = STATE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.known: dict[str, tuple[str, str]] = {}  # task id -> (state, Slurm's reason)
        self.asked_s = -math.inf

    def state(self, job_id: str) -> tuple[str, str]:
        """The task's last known state and Slurm's reason (``("UNKNOWN", "")`` before any answer)."""
        return self.known.get(job_id, ("UNKNOWN", ""))

    def refresh(self, job_ids: Iterable[str], *, fresh: bool = False) -> None:
        """Ask Slurm about ``job_ids`` when ``interval_s`` has passed since the last call (or ``fresh``)."""
        ids = sorted(set(job_ids))
        if not ids or (not fresh and time.monotonic() - self.asked_s < self.interval_s):
            return
        self.asked_s = time.monotonic()
        answered, states = queue_states(ids)
        self.known.update(states)
        missing = [i for i in ids if i not in states]
        if answered and missing:
            self.known.update(accounting_states(missing))


def queue_states(job_ids: Sequence[str]) -> tuple[bool, dict[str, tuple[str, str]]]:
    """Whether ``squeue`` answered, and the states it holds for the arrays of ``job_ids`` (one call)."""
    arrays = sorted({i.split("_")[0] for i in job_ids})
    command = ["squeue", "--states=all", "--array", "--noheader", "--format=%i|%T|%r", f"--jobs={','.join(arrays)}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False, {}
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        return False, {}  # the controller did not answer: no news
    states = {}
    for line in done.stdout.splitlines():
        task, state, reason = ([*line.split("|"), "", ""])[:3]
        states[task.strip()] = (state.strip().split(" ")[0], reason.strip())
    return True, states


def accounting_states(job_ids: Sequence[str]) -> dict[str, tuple[str, str]]:
    """States from accounting (one ``sacct`` call through submitit's shared watcher); ``GONE`` where it
    knows nothing (no accounting on the cluster, or the task is unknown)."""
    watcher = SlurmJob.watcher
    for job_id in job_ids:
        watcher.register_job(job_id)
    watcher.update()
    states = {i: watcher.get_state(i, mode="cache").split(" ")[0] for i in job_ids}
    return {i: (GONE if s == "UNKNOWN" else s, "") for i, s in states.items()}


def death_reason(job_id: str, state: str, reason: str, time_min: int) -> str:
    """One line: which task ended how, without a result."""
    why = WHY.get(state, "it ended").format(time_min=time_min)
    said = f", {reason}" if reason and reason != "None" else ""
    return f"Slurm job {job_id} ended without a result ({state}{said}): {why}"
