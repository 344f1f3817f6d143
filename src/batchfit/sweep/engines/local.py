"""The local engine: this node's devices as slots, one configuration at a time on each, every configuration
in a fresh process (``python -m batchfit.sweep.worker``) whose slot is pinned in its environment before
Python starts (``CUDA_VISIBLE_DEVICES``), so no CUDA state of one probe reaches the next.

A worker that ends without an outcome (SIGKILL from the host's out-of-memory killer, a segfault) is a
``Death`` with its reason; the driver sends it once more in a new process and never takes it as an
out-of-memory bound.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from batchfit.errors import InputError
from batchfit.sweep.engines.base import Ended
from batchfit.sweep.engines.base import Handle
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.options import available_cores
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.worker import THREADS_VARIABLE

POLL_INTERVAL_S = 0.05
STOP_GRACE_S = 5.0
LOG_LINES = 12  # the end of a dead worker's output kept in its record


def visible_gpus() -> int:
    """CUDA devices this process sees, counted without creating a context on any of them."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _refuse_others(options: EngineOptions) -> None:
    given = {
        "--ray-address": options.address,
        "--partition": options.partition,
        "--slurm-folder": options.folder,
        "--time-min": None if options.time_min == EngineOptions.time_min else options.time_min,
        "--gpus-per-task": options.gpus_per_task,
        "--max-parallel": options.max_parallel,
    }
    named = [flag for flag, value in given.items() if value is not None]
    if named:
        raise InputError(
            f"{', '.join(named)} is for the slurm or ray engine: the local engine takes --slots or --workers"
        )


def _gpu_slot(text: str) -> tuple[str, dict[str, str]]:
    kind, _, index = text.strip().partition(":")
    if kind != "cuda" or not index.isdigit():
        raise InputError(f"slot {text!r} is not a CUDA device: give --slots as cuda:0,cuda:1,... or --workers N")
    return f"cuda:{index}", {"CUDA_VISIBLE_DEVICES": index}


def plan_slots(options: EngineOptions, device: str) -> list[tuple[str, dict[str, str]]]:
    """Each slot's label and the environment its workers get: the given ``slots``, else ``workers`` slots on
    the device as it is, else every visible GPU for a CUDA device, else one slot per core."""
    if options.slots is not None and options.workers is not None:
        raise InputError("give --slots (devices) or --workers (a count), not both")
    if options.slots is not None:
        slots = [_gpu_slot(text) for text in options.slots]
        if not slots or len({label for label, _ in slots}) < len(slots):
            raise InputError(f"--slots {','.join(options.slots)} must name each device once: e.g. cuda:0,cuda:1")
        return slots
    if options.workers is not None:
        if not 1 <= options.workers <= 1024:
            raise InputError(f"--workers must be between 1 and 1024, got {options.workers}")
        return [(f"worker {n}", {}) for n in range(1, options.workers + 1)]
    gpus = visible_gpus() if device.split(":")[0] in ("cuda", "auto") else 0
    if gpus:
        return [(f"cuda:{n}", {"CUDA_VISIBLE_DEVICES": str(n)}) for n in range(gpus)]
    if device.startswith("cuda"):
        raise InputError(f"--device {device} but no CUDA device is visible: give --device sim:CAPACITY and --workers N")
    return [(f"worker {n}", {}) for n in range(1, available_cores() + 1)]


class LocalEngine:
    """Slots of this node, a fresh process per configuration (see the module's doc)."""

    name = "local"

    def __init__(self, slots: list[tuple[str, dict[str, str]]], folder: Path | None = None):
        self.environments = dict(slots)
        self.free = [label for label, _ in slots]
        self.folder = folder or Path(tempfile.mkdtemp(prefix="batchfit-sweep-"))
        self.started = 0
        self.running: dict[str, subprocess.Popen] = {}  # by slot
        self.threads = max(1, available_cores() // len(slots))

    @classmethod
    def make(cls, options: EngineOptions, device: str) -> LocalEngine:
        _refuse_others(options)
        return cls(plan_slots(options, device))

    def slots(self) -> list[str]:
        return list(self.environments)

    def room(self, running: int) -> int:
        return len(self.free)

    def submit(self, jobs: Sequence[ConfigJob]) -> list[Handle]:
        if len(jobs) > len(self.free):
            raise InputError(f"{len(jobs)} jobs for {len(self.free)} free slots: send at most room() at once")
        return [self._start(job, self.free.pop(0)) for job in jobs]

    def _start(self, job: ConfigJob, slot: str) -> Handle:
        self.started += 1
        stem = self.folder / f"{self.started:05d}"
        pinned = "CUDA_VISIBLE_DEVICES" in self.environments[slot]
        if pinned and job.device.split(":")[0] in ("cuda", "auto"):
            job = replace(job, device="cuda")  # the slot's device is the only one the worker sees
        Path(f"{stem}.job").write_bytes(pickle.dumps(job))
        environment = {**os.environ, **self.environments[slot]}
        if not pinned:
            environment.setdefault(THREADS_VARIABLE, str(self.threads))
        with open(f"{stem}.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "batchfit.sweep.worker", f"{stem}.job", f"{stem}.outcome"],
                env=environment,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.running[slot] = process
        return Handle(job, slot, None, (process, stem))

    def poll(self, handles: Sequence[Handle], timeout_s: float) -> list[Ended]:
        deadline = time.monotonic() + timeout_s
        while True:
            ended = [(handle, self._ended(handle)) for handle in handles if handle.native[0].poll() is not None]
            if ended or time.monotonic() >= deadline:
                return ended
            time.sleep(POLL_INTERVAL_S)

    def _ended(self, handle: Handle) -> object:
        process, stem = handle.native
        self.running.pop(handle.slot, None)
        self.free.append(handle.slot)
        outcome = Path(f"{stem}.outcome")
        if process.returncode == 0 and outcome.is_file():
            return pickle.loads(outcome.read_bytes())
        return Death(exit_reason(process.returncode), _tail(Path(f"{stem}.log")))

    def reattach(self, job: ConfigJob, token: str) -> Handle | None:
        return None  # a worker dies with its driver

    def close(self) -> None:
        for process in self.running.values():
            process.terminate()
        for process in self.running.values():
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.running.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


def exit_reason(returncode: int) -> str:
    """One line for how a worker ended without an outcome.

    >>> exit_reason(-9)
    "killed by SIGKILL (the host's out-of-memory killer, or a kill)"
    >>> exit_reason(3)
    'exited with code 3 before writing its result'
    """
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
        if name == "SIGKILL":
            return "killed by SIGKILL (the host's out-of-memory killer, or a kill)"
        return f"crashed ({name})" if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL") else f"ended by {name}"
    return f"exited with code {returncode} before writing its result"


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-LOG_LINES:])
    return ""
