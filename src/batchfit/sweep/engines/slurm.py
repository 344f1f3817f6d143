"""The Slurm engine: each configuration a task of one Slurm job array, sent through submitit (the
``batchfit[slurm]`` extra), each task a fresh process that runs ``run_job``.

``submit`` sends a batch as one array (``Executor.map_array``: one ``sbatch`` call). A task that ends leaves
submitit's result pickle in ``folder``; ``poll`` looks for those files (a file check, no call to Slurm) and asks
Slurm for the state only of tasks without one, for all of them in one call and at most once per
``state_interval_s``: ``squeue`` while the controller still holds the job (``MinJobAge`` after it ends), else
accounting (``sacct`` through submitit's watcher, where the cluster keeps it). A task that ended without a
result (killed, timed out, cancelled, lost with its node, over its memory limit) is a ``Death``: one line from
its state and the end of its stderr, never an out-of-memory bound.

A task's token is its Slurm id (``1234_5``); a later driver with the same ``folder`` re-attaches to it
(``reattach``). The driver calls ``close`` when it stops on an error or Ctrl-C, which cancels the tasks still
queued or running; after a clean end nothing runs and it does nothing. Facts on submitit from its source
(``submitit/slurm/slurm.py``, ``submitit/core/core.py``); on job states from Slurm's ``squeue`` manual
("JOB STATE CODES").
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import submitit
    from submitit.core.utils import FailedJobError
    from submitit.core.utils import UncompletedJobError
    from submitit.slurm.slurm import SlurmJob
except ImportError:  # the extra is missing: make_engine names it before this module is used
    pass

from batchfit.errors import InputError
from batchfit.sweep.engines.base import Ended
from batchfit.sweep.engines.base import Handle
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.options import refuse_foreign
from batchfit.sweep.engines.slurm_states import ENDED_STATES
from batchfit.sweep.engines.slurm_states import STATE_INTERVAL_S
from batchfit.sweep.engines.slurm_states import SlurmStates
from batchfit.sweep.engines.slurm_states import death_reason
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import Outcome
from batchfit.sweep.jobs import run_job

SBATCH_MISSING = "sbatch not found: run on a Slurm login node, or use --engine local"
DEFAULT_FOLDER = "batchfit-slurm"
RESULT_INTERVAL_S = 1.0  # result files are looked for this often while poll waits
RESULT_GRACE_S = 15.0  # a task COMPLETED without a result file yet: a shared file system may lag (as submitit waits)
STDERR_TAIL_CHARS = 2000
TOKEN = re.compile(r"\d+(_\d+)?")  # a Slurm job id, or an array task's


@dataclass(frozen=True)
class SlurmSettings:
    """What each task asks Slurm for, and where submitit keeps its files."""

    folder: str = DEFAULT_FOLDER
    """submitit's folder for pickles and logs: on a file system the compute nodes share."""
    partition: str | None = None
    """The partition (``None``: the cluster's default)."""
    time_min: int = 60
    """Each task's time limit in minutes (sbatch ``--time``)."""
    gpus_per_task: int = 0
    """GPUs each task holds (sbatch ``--gpus-per-task``; 0 asks for none)."""
    cpus_per_task: int = 1
    """CPUs each task holds (sbatch ``--cpus-per-task``)."""
    max_parallel: int | None = None
    """At most this many tasks of an array at once (the ``%N`` of sbatch ``--array``; ``None``: submitit's 256)."""

    def __post_init__(self) -> None:
        for name, least in {"time_min": 1, "cpus_per_task": 1, "gpus_per_task": 0, "max_parallel": 1}.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise InputError(f"the Slurm engine needs {name} >= {least}, got {name}={value}")

    def parameters(self) -> dict[str, Any]:
        """``SlurmExecutor.update_parameters`` keywords (submitit's names for sbatch's options)."""
        asked: dict[str, Any] = {
            "job_name": "batchfit-sweep",
            "time": self.time_min,
            "cpus_per_task": self.cpus_per_task,
        }
        optional = {"partition": self.partition, "gpus_per_task": self.gpus_per_task or None}
        optional["array_parallelism"] = self.max_parallel
        return asked | {name: value for name, value in optional.items() if value is not None}


def settings_from(options: EngineOptions, device: str) -> SlurmSettings:
    """``SlurmSettings`` from the sweep's options: an ``InputError`` (one line) for another engine's option."""
    refuse_foreign(options, "slurm")
    gpus = options.gpus_for(device)
    if not float(gpus).is_integer():
        raise InputError(f"Slurm gives whole GPUs to a task: got gpus_per_task={gpus}")
    return SlurmSettings(
        folder=options.folder or DEFAULT_FOLDER,
        partition=options.partition,
        time_min=options.time_min,
        gpus_per_task=int(gpus),
        cpus_per_task=options.cpus_per_task,
        max_parallel=options.max_parallel,
    )


class SlurmEngine:
    """Runs sweep jobs as Slurm array tasks through submitit (see the module's doc).

    ``cluster="debug"`` runs each job in this process when ``poll`` first looks at it (submitit's
    ``DebugExecutor``): for tests, with nothing to re-attach to. ``state_interval_s``: the least time
    between two calls that ask Slurm for states.
    """

    name = "slurm"

    def __init__(
        self, settings: SlurmSettings, *, cluster: str = "slurm", state_interval_s: float = STATE_INTERVAL_S
    ) -> None:
        if cluster not in ("slurm", "debug"):
            raise InputError(f"the Slurm engine runs on cluster 'slurm' or 'debug', got {cluster=}")
        self.settings = settings
        self.debug = cluster == "debug"
        self.folder = Path(settings.folder).expanduser().absolute()
        self.states = SlurmStates(state_interval_s)
        self.executor = self._executor()
        self.live: dict[str, Any] = {}  # submitit jobs sent or re-attached and not yet seen to end, by id
        self.completed_s: dict[str, float] = {}  # when a task was first seen COMPLETED without its result file

    @classmethod
    def make(cls, options: EngineOptions, device: str) -> SlurmEngine:
        """The engine for ``batchfit sweep --engine slurm``; another engine's option, or a machine
        without ``sbatch``, is an ``InputError`` of one line."""
        settings = settings_from(options, device)
        if shutil.which("sbatch") is None or shutil.which("srun") is None:
            raise InputError(SBATCH_MISSING)
        return cls(settings)

    def _executor(self) -> submitit.Executor:
        if self.debug:
            return submitit.DebugExecutor(self.folder)
        executor = submitit.SlurmExecutor(self.folder)
        executor.update_parameters(**self.settings.parameters())
        return executor

    def slots(self) -> list[str]:
        if self.debug:
            return ["slurm debug (this process)"]
        return [f"slurm partition {self.settings.partition or '(default)'}"]

    def room(self, running: int) -> int | None:
        return None  # Slurm queues what it cannot start yet

    def submit(self, jobs: Sequence[ConfigJob]) -> list[Handle]:
        """Send ``jobs`` as one job array, one task per configuration."""
        if not jobs:
            return []
        natives = self.executor.map_array(run_job, list(jobs))
        self.live.update((native.job_id, native) for native in natives)
        slot = self.slots()[0]
        return [Handle(job, slot, None if self.debug else n.job_id, n) for job, n in zip(jobs, natives, strict=True)]

    def poll(self, handles: Sequence[Handle], timeout_s: float) -> list[Ended]:
        """The handles that ended, waiting up to ``timeout_s`` seconds for the first of them."""
        deadline_s = time.monotonic() + timeout_s
        while handles:
            if not self.debug:
                refresh_view(self.folder)
                self.states.refresh(h.native.job_id for h in handles if not has_result(h.native))
            ended = [(handle, end) for handle in handles if (end := self._end(handle.native)) is not None]
            left_s = deadline_s - time.monotonic()
            if ended or left_s <= 0:
                return ended
            time.sleep(min(RESULT_INTERVAL_S, left_s))
        return []

    def _end(self, job: Any) -> Outcome | Death | None:
        """The task's outcome or death once it ended, else ``None``."""
        if self.debug:
            return self._read(job) if job.done() else None
        if has_result(job):
            return self._read(job)
        state, reason = self.states.state(job.job_id)
        if state not in ENDED_STATES or self._lagging(job.job_id, state):
            return None
        if has_result(job):  # it ended between the two looks
            return self._read(job)
        self.live.pop(job.job_id, None)
        return Death(death_reason(job.job_id, state, reason, self.settings.time_min), stderr_tail(job))

    def _lagging(self, job_id: str, state: str) -> bool:
        """Whether a task that COMPLETED may still show its result file (within ``RESULT_GRACE_S``)."""
        if state != "COMPLETED":
            return False
        seen_s = self.completed_s.setdefault(job_id, time.monotonic())
        return time.monotonic() - seen_s < RESULT_GRACE_S

    def _read(self, job: Any) -> Outcome | Death:
        """The outcome in a task's result pickle, or its ``Death`` where submitit recorded an error."""
        self.live.pop(job.job_id, None)
        try:
            outcome = job.result()
        except (FailedJobError, UncompletedJobError) as error:
            line = error_line(str(error))
            return Death(f"Slurm job {job.job_id} failed outside the search: {line}", stderr_tail(job))
        if not isinstance(outcome, Outcome):
            return Death(f"Slurm job {job.job_id} returned {type(outcome).__name__}, not an Outcome", stderr_tail(job))
        return outcome

    def reattach(self, job: ConfigJob, token: str) -> Handle | None:
        """The task ``token`` an earlier driver sent into this ``folder``, when it is queued, running, or
        ended with its result still to read; else ``None`` (the driver sends the job again)."""
        if self.debug or not TOKEN.fullmatch(token):
            return None
        native = SlurmJob(folder=self.folder, job_id=token)
        refresh_view(self.folder)
        if not has_result(native):
            self.states.refresh([token], fresh=token not in self.states.known)
            if self.states.state(token)[0] in ENDED_STATES:
                return None
        self.live[token] = native
        return Handle(job, self.slots()[0], token, native)

    def close(self) -> None:
        """Cancel the tasks still queued or running: the driver calls this when it stops on an error or
        Ctrl-C (after a clean end none is left, and this does nothing)."""
        if not self.debug and self.live:
            subprocess.run(["scancel", *self.live], capture_output=True, timeout=60, check=False)
        for native in self.live.values() if self.debug else ():
            native.cancel()
        self.live.clear()


def refresh_view(folder: Path) -> None:
    """Make a network file system show the folder's new files now (as submitit's ``Job.done`` does: a chmod
    to the same mode), once per look at all the tasks."""
    with contextlib.suppress(OSError):
        folder.chmod(folder.stat().st_mode)


def has_result(job: Any) -> bool:
    """Whether the task left submitit's result pickle (written whole, then renamed: complete when seen)."""
    return bool(job.paths.result_pickle.exists())


def stderr_tail(job: Any, chars: int = STDERR_TAIL_CHARS) -> str:
    """The end of a task's stderr (``""`` when it wrote none)."""
    try:
        text = job.stderr() or ""
    except OSError:
        return ""
    return text[-chars:].strip()


def error_line(message: str) -> str:
    """The line of a submitit error that names the exception (the last ``Name: message`` line of its trace)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Interrupt|Exit)\b", line)]
    chosen = named[-1] if named else (lines[0] if lines else "no message")
    return chosen[:200]
