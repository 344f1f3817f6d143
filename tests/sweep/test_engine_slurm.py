"""The Slurm engine (``batchfit[slurm]``): the records ``run_job`` gives in this process come back through
submitit's ``DebugExecutor`` (fast) and through a real Slurm's job arrays (``-m slurm``: started by
``scripts/slurm/start.sh``), a task SIGKILLed mid-trial is a ``Death`` and runs right when sent again, a new
engine re-attaches to a task by its token, and bad input is one line."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("submitit")
import cloudpickle

from batchfit.errors import InputError
from batchfit.search.settings import SearchSettings
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.workload import Workload
from batchfit.sweep.api import sweep_grid
from batchfit.sweep.engines import EngineOptions
from batchfit.sweep.engines import make_engine
from batchfit.sweep.engines import slurm_states
from batchfit.sweep.engines.base import Handle
from batchfit.sweep.engines.slurm import SBATCH_MISSING
from batchfit.sweep.engines.slurm import SlurmEngine
from batchfit.sweep.engines.slurm import SlurmSettings
from batchfit.sweep.engines.slurm import error_line
from batchfit.sweep.engines.slurm import settings_from
from batchfit.sweep.engines.slurm_states import death_reason
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import JobSettings
from batchfit.sweep.jobs import Outcome
from batchfit.sweep.jobs import run_job
from engine_checks import assert_same_outcome
from engine_checks import without_timings

# The factories below reach Slurm's tasks by value: a task imports batchfit, not this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEVICE = "sim:32MiB"
SETTINGS = JobSettings(SearchSettings(), True, ("trace", "rules"), None)
# forward passes only (mode "eval"): the cheapest searches that still run trials, trace and all
GRID = tuple({"seq_len": seq_len, "layers": 1, "mode": "eval"} for seq_len in (8, 16, 32))
WAIT_S = 300.0  # the longest a real Slurm test waits for its tasks


def slurm_works() -> bool:
    """Whether ``sbatch`` is here and the controller answers (``scontrol ping``: at once, also when it is down)."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    done = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30, check=False)
    return done.returncode == 0 and " is UP" in done.stdout


needs_slurm = pytest.mark.skipif(not slurm_works(), reason="no Slurm answers here: scripts/slurm/start.sh starts one")


def job(knobs: Mapping[str, Any], factory: Any = gpt_tiny) -> ConfigJob:
    return ConfigJob(dict(knobs), factory, DEVICE, SETTINGS, tuple(knobs))


@pytest.fixture(scope="module")
def expected() -> dict[str, Outcome]:
    """Each configuration's outcome from ``run_job`` in this process."""
    return {job(knobs).label: run_job(job(knobs)) for knobs in GRID}


def kill_in_first_trial(marker: str, module: Any, inputs: Any, output: Any) -> None:
    """A forward hook that SIGKILLs its own process in the first real (not traced) forward, once per ``marker``."""
    if not type(output).__name__.startswith("Fake") and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)


def dies_once(marker: str, **knobs: Any) -> Workload:
    """``gpt_tiny`` whose process is killed in its first trial the first time it runs (see ``marker``)."""
    workload = gpt_tiny(**knobs)
    workload.model.register_forward_hook(functools.partial(kill_in_first_trial, marker))
    return workload


def wait_all(engine: SlurmEngine, handles: list[Handle]) -> dict[str, Outcome | Death]:
    """Every handle's end, by configuration, polling as a driver does."""
    ends: dict[str, Outcome | Death] = {}
    waiting = list(handles)
    deadline_s = time.monotonic() + WAIT_S
    while waiting and time.monotonic() < deadline_s:
        for handle, end in engine.poll(waiting, timeout_s=10):
            ends[handle.job.label] = end
            waiting.remove(handle)
    assert not waiting, f"still waiting after {WAIT_S} s: {[h.token for h in waiting]}"
    return ends


# --- fast: submitit's DebugExecutor runs each task in this process ---------------------------------------


def test_debug_engine_gives_the_records_of_run_job(tmp_path: Path, expected: dict[str, Outcome]) -> None:
    engine = SlurmEngine(SlurmSettings(folder=str(tmp_path)), cluster="debug")
    handles = engine.submit([job(knobs) for knobs in GRID])
    assert [h.token for h in handles] == [None] * len(GRID)  # nothing to re-attach to
    ends = wait_all(engine, handles)
    assert ends.keys() == expected.keys()
    for label, outcome in expected.items():
        assert_same_outcome(ends[label], outcome)
    assert engine.room(running=5) is None
    assert not engine.live


def test_debug_close_cancels_what_did_not_run(tmp_path: Path) -> None:
    engine = SlurmEngine(SlurmSettings(folder=str(tmp_path)), cluster="debug")
    (handle,) = engine.submit([job(GRID[0])])
    engine.close()
    assert handle.native.cancelled and not engine.live


def test_missing_sbatch_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(InputError) as caught:
        make_engine("slurm", EngineOptions(), DEVICE)
    assert str(caught.value) == SBATCH_MISSING


@pytest.mark.parametrize(
    ("option", "value"), [("slots", ("cuda:0",)), ("workers", 2), ("address", "auto"), ("gpus_per_task", 0.5)]
)
def test_other_engines_options_are_refused_in_one_line(option: str, value: Any) -> None:
    with pytest.raises(InputError) as caught:
        make_engine("slurm", EngineOptions(**{option: value}), DEVICE)
    message = str(caught.value)
    assert "\n" not in message and (option in message or "gpus" in message)


def test_options_become_sbatch_parameters() -> None:
    options = EngineOptions(partition="gpu", time_min=30, cpus_per_task=4, folder="runs", max_parallel=8)
    assert settings_from(options, "cuda:0").parameters() == {
        "job_name": "batchfit-sweep",
        "time": 30,
        "cpus_per_task": 4,
        "partition": "gpu",
        "gpus_per_task": 1,  # a CUDA device: one GPU per task unless told
        "array_parallelism": 8,
    }
    assert settings_from(EngineOptions(), DEVICE).gpus_per_task == 0
    assert settings_from(EngineOptions(), DEVICE).folder == "batchfit-slurm"
    with pytest.raises(InputError, match="time_min >= 1"):
        SlurmSettings(time_min=0)


def test_deaths_read_as_one_line_and_never_as_a_device_bound() -> None:
    line = death_reason("12_3", "OUT_OF_MEMORY", "None", 60)
    assert line.startswith("Slurm job 12_3 ended without a result (OUT_OF_MEMORY)")
    assert "not a device out-of-memory bound" in line and "\n" not in line
    assert "time limit of 5 min" in death_reason("12", "TIMEOUT", "", 5)
    assert error_line("Job (task=0) failed:\n---\nTraceback\n  x\nModuleNotFoundError: no module 'm'\n---") == (
        "ModuleNotFoundError: no module 'm'"
    )


def fake_squeue(monkeypatch: pytest.MonkeyPatch, returncode: int, stdout: str = "", stderr: str = "") -> None:
    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert command[0] == "squeue" and command[-1] == "--jobs=12"  # one call for the array's tasks
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)

    monkeypatch.setattr(slurm_states.subprocess, "run", run)
    monkeypatch.setattr(slurm_states, "accounting_states", lambda ids: dict.fromkeys(ids, (slurm_states.GONE, "")))


def test_states_come_from_one_squeue_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(monkeypatch, 0, "12_0|FAILED|NonZeroExitCode\n12_1|RUNNING|None\n")
    states = slurm_states.SlurmStates(interval_s=0)
    states.refresh(["12_0", "12_1", "12_2"])
    assert states.state("12_0") == ("FAILED", "NonZeroExitCode")
    assert states.state("12_1") == ("RUNNING", "None")
    assert states.state("12_2") == (slurm_states.GONE, "")  # neither squeue nor accounting knows it


def test_a_silent_controller_ends_no_task(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_squeue(monkeypatch, 1, stderr="squeue: error: Unable to contact slurm controller (connect failure)")
    states = slurm_states.SlurmStates(interval_s=0)
    states.refresh(["12_0"])
    assert states.state("12_0")[0] not in slurm_states.ENDED_STATES


# --- a real Slurm (scripts/slurm/start.sh; make slurm-check) ---------------------------------------------


def real_engine(folder: Path) -> SlurmEngine:
    return SlurmEngine(SlurmSettings(folder=str(folder), time_min=10), state_interval_s=2.0)


@pytest.mark.slurm
@needs_slurm
def test_one_array_on_slurm_gives_the_records_of_run_job(tmp_path: Path, expected: dict[str, Outcome]) -> None:
    engine = real_engine(tmp_path)
    handles = engine.submit([job(knobs) for knobs in GRID])
    tokens = [str(h.token) for h in handles]
    array = tokens[0].split("_")[0]
    assert tokens == [f"{array}_{i}" for i in range(len(GRID))]  # one array, a task per configuration
    ends = wait_all(engine, handles)
    for label, outcome in expected.items():
        assert_same_outcome(ends[label], outcome)
    assert all(isinstance(end, Outcome) and end.pid != os.getpid() for end in ends.values())


@pytest.mark.slurm
@needs_slurm
def test_a_task_killed_mid_trial_is_a_death_and_runs_again(tmp_path: Path, expected: dict[str, Outcome]) -> None:
    marker = tmp_path / "killed-once"
    sent = job(GRID[0], functools.partial(dies_once, str(marker)))
    engine = real_engine(tmp_path / "slurm")
    (handle,) = engine.submit([sent])
    death = wait_all(engine, [handle])[sent.label]
    assert isinstance(death, Death) and marker.exists()
    assert death.reason.startswith(f"Slurm job {handle.token} ended without a result (FAILED")
    assert "\n" not in death.reason
    assert real_engine(tmp_path / "slurm").reattach(sent, str(handle.token)) is None  # the driver sends it again
    (again,) = engine.submit([sent.again(())])
    assert_same_outcome(wait_all(engine, [again])[sent.label], expected[sent.label])


@pytest.mark.slurm
@needs_slurm
def test_a_new_engine_reattaches_by_token(tmp_path: Path, expected: dict[str, Outcome]) -> None:
    sent = job(GRID[1])
    (handle,) = real_engine(tmp_path).submit([sent])
    token = str(handle.token)
    later = real_engine(tmp_path)  # a driver started again: same folder, only the token
    attached = later.reattach(sent, token)
    assert attached is not None and attached.token == token
    assert_same_outcome(wait_all(later, [attached])[sent.label], expected[sent.label])
    finished = real_engine(tmp_path).reattach(sent, token)  # ended, its result still to read
    assert finished is not None
    assert_same_outcome(wait_all(real_engine(tmp_path), [finished])[sent.label], expected[sent.label])
    assert real_engine(tmp_path).reattach(sent, "999999_0") is None
    assert real_engine(tmp_path).reattach(sent, "not-a-slurm-id") is None


@pytest.mark.slurm
@needs_slurm
def test_close_cancels_the_tasks_still_queued(tmp_path: Path) -> None:
    engine = real_engine(tmp_path)
    (handle,) = engine.submit([job(GRID[2])])
    engine.close()
    ends = wait_all(real_engine(tmp_path), [dataclasses.replace(handle)])
    death = ends[handle.job.label]
    assert isinstance(death, Death) and "(CANCELLED" in death.reason


@pytest.mark.slurm
@needs_slurm
def test_a_sweep_on_slurm_gives_the_local_engines_records(tmp_path: Path) -> None:
    grid = {"seq_len": [8, 16, 32], "layers": [1], "mode": ["eval"]}
    sweeps = {
        engine: sweep_grid(gpt_tiny, grid, device=DEVICE, cache=False, engine=engine, engine_options=options)
        for engine, options in [("local", {"workers": 2}), ("slurm", {"folder": str(tmp_path / "slurm")})]
    }
    local, on_slurm = ([without_timings({**r, "ran_on": None}) for r in sweeps[e].records] for e in ("local", "slurm"))
    assert on_slurm == local
    assert {r["ran_on"]["engine"] for r in sweeps["slurm"].records} == {"slurm"}
