"""What an engine does for a sweep: run ``run_job`` for each configuration in a fresh process somewhere (a
slot of this node, a Slurm job, a Ray task), and say when each ends, with its ``Outcome`` or its ``Death``.

The driver (``batchfit.sweep.parallel``) decides what to send and when; it alone writes the results file and
the result cache. An engine only runs jobs: ``submit`` a batch (one job array on Slurm), ``poll`` for those
that ended, ``reattach`` to a job an earlier driver sent (by its ``token``), ``close``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import Protocol

from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import Outcome


@dataclass
class Handle:
    """A job sent to an engine: the job, where it runs (``slot``, a label), and ``token``, the engine's
    own id for it (a Slurm job id) when a later driver can re-attach to it, else ``None``. ``native``
    is the engine's own object (a process, a submitit job, a Ray reference)."""

    job: ConfigJob
    slot: str
    token: str | None = None
    native: Any = None


Ended = tuple[Handle, "Outcome | Death"]


class Engine(Protocol):
    """Runs sweep jobs, each in a fresh process (see the module's doc)."""

    name: str

    def slots(self) -> list[str]:
        """Where jobs run, as labels for the summary (``cuda:0``, ``worker 1``, a Slurm partition, a Ray address)."""
        ...

    def room(self, running: int) -> int | None:
        """How many more jobs to send now, with ``running`` in flight; ``None``: as many as there are (the
        engine queues them itself, as Slurm does)."""
        ...

    def submit(self, jobs: Sequence[ConfigJob]) -> list[Handle]:
        """Start ``jobs`` (one batch: a job array where the engine has them)."""
        ...

    def poll(self, handles: Sequence[Handle], timeout_s: float) -> list[Ended]:
        """The handles among ``handles`` that ended within ``timeout_s`` seconds, each with its outcome."""
        ...

    def reattach(self, job: ConfigJob, token: str) -> Handle | None:
        """The job an earlier driver sent as ``token``, when it is still running or has finished with its
        outcome still to be read; ``None`` sends it again."""
        ...

    def close(self) -> None:
        """Stop what is still running (the driver stops early only on an error or Ctrl-C) and free the engine."""
        ...
