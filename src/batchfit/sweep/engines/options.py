"""The engines' names and options: ``EngineOptions`` (where and how an engine runs jobs) and ``check_engine``
(an unknown engine, or one whose extra is not installed, is one ``InputError`` naming the extra)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from batchfit.errors import InputError

ENGINES = ("inline", "local", "slurm", "ray")
EXTRAS = {"slurm": "submitit", "ray": "ray"}


@dataclass(frozen=True)
class EngineOptions:
    """Where and how an engine runs jobs; each engine reads its own fields and refuses the others'.

    ``slots`` (local): devices, one job on each at a time (``("cuda:0", "cuda:1")``; default every visible
    GPU); ``workers`` (local): that many slots on a simulated device or the CPU. ``address`` (ray): the
    cluster (``"auto"``, ``"ray://host:10001"``; default a local cluster). ``gpus_per_task`` and
    ``cpus_per_task`` (slurm, ray): what each job holds (GPUs default to 1 on a CUDA device, else 0).
    ``partition``, ``time_min``, ``folder`` (slurm): the partition, each job's time limit in minutes and the
    folder for submitit's files and logs. ``max_parallel`` (slurm, ray): at most this many jobs at once.
    """

    slots: tuple[str, ...] | None = None
    workers: int | None = None
    address: str | None = None
    gpus_per_task: float | None = None
    cpus_per_task: int = 1
    partition: str | None = None
    time_min: int = 60
    folder: str | None = None
    max_parallel: int | None = None

    def gpus_for(self, device: str) -> float:
        """GPUs each task holds: as given, else 1 on a CUDA device and 0 elsewhere.

        >>> EngineOptions().gpus_for("cuda:0"), EngineOptions(gpus_per_task=0.5).gpus_for("cuda")
        (1, 0.5)
        """
        if self.gpus_per_task is not None:
            return self.gpus_per_task
        return 1 if device.startswith("cuda") else 0


OWNERS = {  # the options that belong to one engine, as the command line names them
    "slots": ("--slots", "local"),
    "workers": ("--workers", "local"),
    "address": ("--ray-address", "ray"),
    "partition": ("--partition", "slurm"),
    "folder": ("--slurm-folder", "slurm"),
}


def refuse_foreign(options: EngineOptions, engine: str) -> None:
    """A one-line ``InputError`` for an option given that belongs to another engine than ``engine``."""
    for name, (flag, owner) in OWNERS.items():
        if owner != engine and getattr(options, name) is not None:
            raise InputError(
                f"{flag} is an option of the {owner} engine, not of {engine}: drop it or use --engine {owner}"
            )


def check_engine(name: str) -> None:
    """An ``InputError`` for an unknown engine, or one whose extra is not installed (naming it)."""
    if name not in ENGINES:
        raise InputError(f"unknown engine {name!r}: choose from {', '.join(ENGINES)}")
    module = EXTRAS.get(name)
    if module is not None and importlib.util.find_spec(module) is None:
        raise InputError(f"the {name} engine needs {module}: pip install 'batchfit[{name}]'")


def available_cores() -> int:
    """The CPUs this process may run on (the local engine's default slots, a local Ray cluster's CPUs)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
