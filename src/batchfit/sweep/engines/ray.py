"""The Ray engine (the ``batchfit[ray]`` extra): each configuration a Ray task that runs ``run_job`` in a
fresh worker process, on an existing cluster (``address="auto"`` or ``"ray://head:10001"``) or on a local
one the engine starts (``address=None``) and stops again in ``close``.

Each task is ``ray.remote(num_gpus=k, num_cpus=c, max_calls=1, max_retries=0)``: ``max_calls=1`` makes its
worker exit after one task, Ray's own remedy for GPU memory a library does not give back (the ``ray.remote``
API reference); ``max_retries=0`` leaves the retry to the driver, which sends a ``Death`` once more (Ray
retries a task whose worker died 3 times by default: "Fault Tolerance > Tasks"). Ray sets
``CUDA_VISIBLE_DEVICES`` to the GPUs it gives a task ("Accelerator Support"), so a task on a CUDA device
probes ``cuda``, the first of them. A task dies with the driver that sent it, so nothing is re-attached.

A task that ends without a record (its worker killed or crashed, its node lost, Ray's memory monitor) is a
``Death`` with one line of reason, never an out-of-memory bound. An address nothing answers on is one
``InputError`` line within ``CONNECT_TIMEOUT_S``: Ray itself would retry for minutes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

from batchfit.errors import InputError
from batchfit.sweep.engines.base import Ended
from batchfit.sweep.engines.base import Handle
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.options import refuse_foreign
from batchfit.sweep.engines.ray_cluster import ANSI
from batchfit.sweep.engines.ray_cluster import connect
from batchfit.sweep.engines.ray_cluster import first_line
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import Outcome
from batchfit.sweep.jobs import run_job

try:
    import ray
    import ray.exceptions
except ImportError:  # the extra is missing: make_engine names it before this module is used
    pass

logger = logging.getLogger("batchfit")

DETAIL_CHARS = 2000
# other engines' options, with their command-line names
# Why a task ended without a record, by the class of what ray.get raised (ray.exceptions); the first match wins
WHY = (
    ("OutOfMemoryError", "Ray's memory monitor killed its worker: the node ran low on host memory"),
    ("WorkerCrashedError", "its Ray worker died (killed, crashed, or stopped by the host's OOM killer)"),
    ("NodeDiedError", "the Ray node running it died"),
    ("LocalRayletDiedError", "the Ray node running it died"),
    ("TaskUnschedulableError", "Ray could not schedule it"),
    ("RayActorError", "the Ray actor running it died"),
    ("TaskCancelledError", "it was cancelled"),
    ("ObjectLostError", "its result was lost with the Ray node that held it"),
    ("RuntimeEnvSetupError", "Ray could not set up its runtime environment"),
    ("OutOfDiskError", "the Ray node ran out of disk"),
)


@dataclass(frozen=True)
class RaySettings:
    """Where the tasks run and what each one holds."""

    address: str | None = None
    """The cluster: ``"auto"``, ``"host:6379"``, ``"ray://host:10001"``; ``None`` starts a local one."""
    gpus_per_task: float = 0.0
    """GPUs each task holds (Ray's ``num_gpus``; a fraction shares a GPU between tasks)."""
    cpus_per_task: float = 1.0
    """CPUs each task holds (Ray's ``num_cpus``)."""
    max_parallel: int | None = None
    """At most this many tasks at once (``None``: as many as the cluster's CPUs and GPUs hold)."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_task", "cpus_per_task"):
            if getattr(self, name) < 0:
                raise InputError(f"the Ray engine needs {name} >= 0, got {name}={getattr(self, name)}")
        if self.max_parallel is not None and self.max_parallel < 1:
            raise InputError(f"the Ray engine needs max_parallel >= 1, got max_parallel={self.max_parallel}")

    def task_options(self) -> dict[str, Any]:
        """``ray.remote`` keywords: a fresh worker per task, no retry by Ray."""
        return {"num_gpus": self.gpus_per_task, "num_cpus": self.cpus_per_task, "max_calls": 1, "max_retries": 0}

    def capacity(self, resources: Mapping[str, float]) -> int:
        """How many tasks run at once on a cluster with ``resources`` (at least 1).

        >>> RaySettings(cpus_per_task=2).capacity({"CPU": 8.0, "GPU": 0.0})
        4
        >>> RaySettings(gpus_per_task=1).capacity({"CPU": 16.0, "GPU": 2.0})
        2
        >>> RaySettings(max_parallel=3).capacity({"CPU": 64.0})
        3
        """
        if self.max_parallel is not None:
            return self.max_parallel
        asked = {"CPU": self.cpus_per_task, "GPU": self.gpus_per_task}
        fits = [resources.get(name, 0.0) // amount for name, amount in asked.items() if amount > 0]
        return max(1, int(min(fits, default=1)))


def settings_from(options: EngineOptions, device: str) -> RaySettings:
    """``RaySettings`` from the sweep's options: an ``InputError`` (one line) for another engine's option."""
    refuse_foreign(options, "ray")
    if options.time_min != EngineOptions().time_min:  # only Slurm limits a task's time
        raise InputError("--time-min is an option of the slurm engine, not of ray: drop it or use --engine slurm")
    gpus = float(options.gpus_for(device))
    return RaySettings(options.address, gpus, float(options.cpus_per_task), options.max_parallel)


def task_device(device: str, gpus_per_task: float) -> str:
    """The device a task probes: ``cuda`` (the first GPU Ray gave it) for a CUDA device or ``auto`` when it
    holds GPUs, else ``device`` as given.

    >>> task_device("cuda:3", 1.0), task_device("auto", 1.0), task_device("sim:32MiB", 0.0)
    ('cuda', 'cuda', 'sim:32MiB')
    """
    if gpus_per_task > 0 and device.split(":")[0] in ("cuda", "auto"):
        return "cuda"
    return device


class RayEngine:
    """Runs each sweep job as a Ray task in a fresh worker (see the module's doc)."""

    name = "ray"

    def __init__(self, settings: RaySettings, label: str, owns_connection: bool) -> None:
        self.settings = settings
        self.label = label
        self.owns_connection = owns_connection  # this engine called ray.init, so close calls ray.shutdown
        self.remote = ray.remote(**settings.task_options())(run_job)  # a new RemoteFunction; run_job is untouched
        self.live: dict[Any, Handle] = {}  # what was sent and has not been polled as ended, by its ObjectRef

    @classmethod
    def make(cls, options: EngineOptions, device: str) -> RayEngine:
        """The engine for ``options`` on ``device``: connects to (or starts) the cluster.

        A process that already called ``ray.init`` keeps its connection (and ``close`` leaves it open)."""
        settings = settings_from(options, device)
        owns = connect(settings.address)
        resources = ray.cluster_resources()
        try:
            check_fits(settings, resources, own_cluster=owns and settings.address is None)
        except InputError:
            if owns:
                ray.shutdown()
            raise
        return cls(settings, slot_label(settings.address, resources), owns)

    def slots(self) -> list[str]:
        return [self.label]

    def room(self, running: int) -> int:
        return max(self.settings.capacity(ray.cluster_resources()) - running, 0)

    def submit(self, jobs: Sequence[ConfigJob]) -> list[Handle]:
        handles = []
        for job in jobs:
            sent = replace(job, device=task_device(job.device, self.settings.gpus_per_task))
            handle = Handle(job, self.label, native=self.remote.remote(sent))
            self.live[handle.native] = handle
            handles.append(handle)
        return handles

    def poll(self, handles: Sequence[Handle], timeout_s: float) -> list[Ended]:
        if not handles:
            return []
        by_ref = {handle.native: handle for handle in handles}
        first, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
        if not first:
            return []
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)  # the others already ended
        for ref in ready:
            self.live.pop(ref, None)
        return [(by_ref[ref], ended(ref)) for ref in ready]

    def reattach(self, job: ConfigJob, token: str) -> Handle | None:
        return None  # a Ray task dies with the driver that sent it: it is sent again

    def close(self) -> None:
        for ref in list(self.live):
            ray.cancel(ref, force=True)  # force: its worker is killed, GPU memory and all
        self.live.clear()
        if self.owns_connection and ray.is_initialized():
            ray.shutdown()  # stops a cluster this engine started; only disconnects from one it joined


def check_fits(settings: RaySettings, resources: Mapping[str, float], *, own_cluster: bool) -> None:
    """An ``InputError`` when no node can hold one task: on a cluster this engine started that is final; a
    cluster it joined may add nodes (an autoscaler), so there it is only a warning."""
    asked = {"CPU": settings.cpus_per_task, "GPU": settings.gpus_per_task}
    short = [f"{amount:g} {name}" for name, amount in asked.items() if amount > resources.get(name, 0.0)]
    if not short:
        return
    line = f"each Ray task asks for {' and '.join(short)}, more than the cluster has ({describe(resources)})"
    if own_cluster:
        raise InputError(f"{line}: give a smaller --gpus-per-task/--cpus-per-task, or --ray-address of a bigger one")
    logger.warning("%s: the tasks wait until the cluster grows", line)


def describe(resources: Mapping[str, float]) -> str:
    """``"8 CPU, 2 GPU"``, or ``"8 CPU"`` without GPUs.

    >>> describe({"CPU": 8.0, "GPU": 2.0, "memory": 1e9}), describe({"CPU": 2.0})
    ('8 CPU, 2 GPU', '2 CPU')
    """
    gpus = resources.get("GPU", 0.0)
    return f"{resources.get('CPU', 0.0):g} CPU" + (f", {gpus:g} GPU" if gpus else "")


def slot_label(address: str | None, resources: Mapping[str, float]) -> str:
    """The engine's one slot, for the summary: ``ray@local (2 CPU)``, ``ray@10.0.0.1:6379 (64 CPU, 8 GPU)``."""
    where = address or "local"
    if where == "auto":
        where = getattr(ray.get_runtime_context(), "gcs_address", None) or where
    return f"ray@{where} ({describe(resources)})"


def ended(ref: Any) -> Outcome | Death:
    """The outcome of the task behind ``ref``, which has ended: its ``Outcome``, or a ``Death``."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:
        return death_of(error)
    except Exception as error:  # whatever else ray.get raises: the task gave no record either
        return Death(f"reading the Ray task's result failed: {first_line(error)}", tail(error))


def death_of(error: Exception) -> Death:
    """A ``Death`` with one line of reason for what ``ray.get`` raised, never an out-of-memory bound."""
    name = type(error).__name__
    for cls_name, why in WHY:
        cls = getattr(ray.exceptions, cls_name, None)
        if cls is not None and isinstance(error, cls):
            return Death(f"the Ray task ended without a record: {why} ({name})", tail(error))
    if isinstance(error, ray.exceptions.RayTaskError):  # run_job catches the job's errors: this is Ray's own
        return Death(f"the Ray task failed outside the search: {first_line(error, last=True)}", tail(error))
    return Death(f"the Ray task ended without a record: {name}: {first_line(error)}", tail(error))


def tail(error: BaseException) -> str:
    """The end of what Ray said, without its colours."""
    return ANSI.sub("", str(error))[-DETAIL_CHARS:]
