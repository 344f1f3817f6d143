"""The Ray engine (``batchfit[ray]``) on a real local Ray cluster, never a mock: the records ``run_job`` gives
in this process come back from Ray's tasks, each in a fresh worker; a task SIGKILLed mid-trial is a ``Death``
and runs right when sent again; ``close`` kills what runs and stops only a cluster the engine started; a
factory the workers cannot import is a ``Death`` naming it; bad input is one line, an unreachable address
within seconds; ``sweep_grid(..., engine="ray")`` answers as the sequential sweep does.

Starting Ray takes seconds, so the whole module is ``slow`` (``make reliability``)."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
import ray
import ray.cloudpickle
import ray.exceptions
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.errors import InputError
from batchfit.search.settings import SearchSettings
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.workload import Workload
from batchfit.sweep.api import sweep_grid
from batchfit.sweep.engines import EngineOptions
from batchfit.sweep.engines import make_engine
from batchfit.sweep.engines.base import Handle
from batchfit.sweep.engines.ray import RayEngine
from batchfit.sweep.engines.ray import RaySettings
from batchfit.sweep.engines.ray import check_fits
from batchfit.sweep.engines.ray import death_of
from batchfit.sweep.engines.ray import settings_from
from batchfit.sweep.engines.ray_cluster import available_cores
from batchfit.sweep.engines.ray_cluster import bootstrap_address
from batchfit.sweep.engines.ray_cluster import gcs_answer
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import JobSettings
from batchfit.sweep.jobs import Outcome
from batchfit.sweep.jobs import run_job
from engine_checks import assert_same_outcome

pytestmark = pytest.mark.slow

# The factories below reach Ray's workers by value: a worker imports batchfit, not this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEVICE = "sim:32MiB"
SETTINGS = JobSettings(SearchSettings(), True, ("trace", "rules"), None)
GRID = tuple({"seq_len": seq_len, "layers": layers} for seq_len, layers in ((8, 2), (16, 2), (32, 2), (16, 1)))
WAIT_S = 120.0  # the longest a test waits for its tasks


def job(knobs: Mapping[str, Any], factory: Any = gpt_tiny) -> ConfigJob:
    return ConfigJob(dict(knobs), factory, DEVICE, SETTINGS, tuple(knobs))


def wait_all(engine: RayEngine, handles: list[Handle]) -> dict[str, Outcome | Death]:
    """How every handle ended, by configuration, polling as the driver does."""
    ends: dict[str, Outcome | Death] = {}
    waiting = list(handles)
    deadline_s = time.monotonic() + WAIT_S
    while waiting and time.monotonic() < deadline_s:
        for handle, end in engine.poll(waiting, timeout_s=5.0):
            ends[handle.job.label] = end
            waiting.remove(handle)
    assert not waiting, f"still running after {WAIT_S} s: {[h.job.label for h in waiting]}"
    return ends


def kill_once(marker: str, loss_fn: Any, output: Any, *rest: Any) -> Any:
    """The loss, except that its first real call (a trial, not a trace) SIGKILLs its own process: once,
    while ``marker`` does not exist."""
    if not isinstance(output, FakeTensor) and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return loss_fn(output, *rest)


def dies_in_first_trial(marker: str, **knobs: Any) -> Workload:
    """``gpt_tiny`` whose process is killed in the middle of its first trial, the first time it runs."""
    workload = gpt_tiny(**knobs)
    return dataclasses.replace(workload, loss_fn=functools.partial(kill_once, marker, workload.loss_fn))


def sleeps(pid_file: str, **knobs: Any) -> Workload:
    """Writes its process id to ``pid_file`` and sleeps far longer than any test waits."""
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)
    return gpt_tiny(**knobs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def expected() -> dict[str, Outcome]:
    """Each configuration's outcome from ``run_job`` in this process."""
    return {job(knobs).label: run_job(job(knobs)) for knobs in GRID}


@pytest.fixture(scope="module", autouse=True)
def _stop_ray() -> Iterator[None]:
    yield
    ray.shutdown()


@pytest.fixture
def cluster() -> None:
    """A local Ray cluster of 2 CPUs started by the test (kept for the module's next tests); engines made
    while it runs join it and leave it running."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)


# --- a cluster the engine starts itself ------------------------------------------------------------------


def test_a_cluster_the_engine_starts_gives_the_records_of_run_job(expected: dict[str, Outcome]) -> None:
    ray.shutdown()  # whatever an earlier test left: this engine starts its own
    engine = make_engine("ray", EngineOptions(), DEVICE)
    try:
        assert isinstance(engine, RayEngine) and engine.owns_connection
        assert engine.slots() == [f"ray@local ({available_cores()} CPU)"]
        handles = engine.submit([job(knobs) for knobs in GRID])
        assert [h.token for h in handles] == [None] * len(GRID)  # nothing to re-attach to
        ends = wait_all(engine, handles)
    finally:
        engine.close()
    assert not ray.is_initialized()  # the cluster it started is stopped
    assert ends.keys() == expected.keys()
    for label, outcome in expected.items():
        assert_same_outcome(ends[label], outcome)
    pids = {end.pid for end in ends.values() if isinstance(end, Outcome)}
    assert len(pids) == len(GRID) and os.getpid() not in pids  # max_calls=1: a fresh worker per configuration


def test_a_gpu_task_on_a_cluster_without_gpus_is_refused_and_the_cluster_stopped() -> None:
    ray.shutdown()
    with pytest.raises(InputError, match=r"^each Ray task asks for 1 GPU, more than the cluster has \(\d+ CPU\)"):
        make_engine("ray", EngineOptions(), "cuda")  # a CUDA device: one GPU per task unless told
    assert not ray.is_initialized()


# --- a cluster the test started ----------------------------------------------------------------------------


def test_a_task_killed_mid_trial_is_a_death_and_runs_right_when_sent_again(cluster: None, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    knobs = {"seq_len": 16, "layers": 1, "marker": str(marker)}
    first_try = job(knobs, dies_in_first_trial)
    engine = RayEngine.make(EngineOptions(), DEVICE)
    try:
        (died,) = wait_all(engine, engine.submit([first_try])).values()
        assert marker.exists()  # it was killed in its trial, after the trace
        assert isinstance(died, Death), died
        assert died.reason.startswith("the Ray task ended without a record: its Ray worker died")
        assert "\n" not in died.reason and "out of memory" not in died.reason.lower()
        (again,) = wait_all(engine, engine.submit([first_try.again(())])).values()
    finally:
        engine.close()
    assert ray.is_initialized()  # a cluster the engine joined is left running
    assert_same_outcome(again, run_job(first_try))  # in this process, the marker there: no kill


def test_close_kills_the_running_task_and_leaves_a_joined_cluster(cluster: None, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    engine = RayEngine.make(EngineOptions(), DEVICE)
    (handle,) = engine.submit([job({"seq_len": 8, "pid_file": str(pid_file)}, sleeps)])
    deadline_s = time.monotonic() + WAIT_S
    while not pid_file.exists() and time.monotonic() < deadline_s:
        time.sleep(0.2)
    pid = int(pid_file.read_text())
    engine.close()
    ((_, end),) = engine.poll([handle], timeout_s=30.0)
    assert isinstance(end, Death)  # Ray 2.60 says it was cancelled; 2.40 that its worker died
    assert "cancelled" in end.reason or "WorkerCrashedError" in end.reason
    deadline_s = time.monotonic() + 10.0
    while alive(pid) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    assert not alive(pid) and ray.is_initialized()


def test_a_factory_the_workers_cannot_import_is_a_death_naming_it(
    cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "only_here.py").write_text(
        "from batchfit.step.builtin_workloads import gpt_tiny\n\ndef factory(**knobs):\n    return gpt_tiny(**knobs)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # this process imports it; Ray's workers do not see the folder
    from only_here import factory

    engine = RayEngine.make(EngineOptions(), DEVICE)
    try:
        (end,) = wait_all(engine, engine.submit([job({"seq_len": 8}, factory)])).values()
    finally:
        engine.close()
    assert isinstance(end, Death)
    assert end.reason == "the Ray task failed outside the search: ModuleNotFoundError: No module named 'only_here'"


def test_room_is_the_cluster_divided_by_each_task_or_max_parallel(cluster: None) -> None:
    assert ray.cluster_resources()["CPU"] == 2
    engine = RayEngine.make(EngineOptions(), DEVICE)
    assert [engine.room(running) for running in range(4)] == [2, 1, 0, 0]
    assert engine.slots() == ["ray@local (2 CPU)"]
    assert RayEngine.make(EngineOptions(cpus_per_task=2), DEVICE).room(0) == 1
    assert RayEngine.make(EngineOptions(max_parallel=5), DEVICE).room(1) == 4


def test_sweep_grid_on_ray_answers_as_the_sequential_sweep(cluster: None) -> None:
    grid = {"seq_len": [8, 32], "layers": [1, 2]}
    inline = sweep_grid(gpt_tiny, grid, device=DEVICE, cache=False, engine="inline")
    fanned = sweep_grid(gpt_tiny, grid, device=DEVICE, cache=False, engine="ray")
    assert fanned.ran_on == {"engine": "ray", "slots": {"ray@local (2 CPU)": 4}}
    answer = ("seq_len", "layers", "batch_size_used", "fits", "peak_bytes", "limit_bytes")
    assert [{k: r.get(k) for k in answer} for r in fanned.records] == [
        {k: r.get(k) for k in answer} for r in inline.records
    ]


# --- no cluster needed ------------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_an_unreachable_address_is_one_line(address: str) -> None:
    with pytest.raises(InputError) as caught:
        make_engine("ray", EngineOptions(address=address), DEVICE)
    assert str(caught.value) == (
        f"cannot reach the Ray cluster at {address}: start it with `ray start --head` or drop --ray-address"
    )


def test_an_address_that_accepts_and_says_nothing_is_given_up_on_in_seconds() -> None:
    """Ray's GCS client alone waited 40 s on such an address (ray 2.60); the probe gives it up at its deadline
    (``silent``) rather than wait for it, and the engine refuses the address in one line."""
    with socket.create_server(("0.0.0.0", 0)) as silent:  # every address: Ray turns 127.0.0.1 into this node's
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        assert gcs_answer(bootstrap_address(address), time.monotonic() + 0.5) == "silent"
        with pytest.raises(InputError, match=rf"^no Ray cluster answers at {address} \(something else listens on "):
            make_engine("ray", EngineOptions(address=address), DEVICE)


def test_auto_reads_ray_address_and_refuses_a_dead_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(InputError, match=r"^cannot reach the Ray cluster at auto: start it"):
        make_engine("ray", EngineOptions(address="auto"), DEVICE)


@pytest.mark.parametrize(
    ("option", "value"),
    [("slots", ("cuda:0",)), ("workers", 2), ("partition", "gpu"), ("folder", "runs"), ("time_min", 30)],
)
def test_other_engines_options_are_refused_in_one_line(option: str, value: Any) -> None:
    with pytest.raises(InputError) as caught:
        make_engine("ray", EngineOptions(**{option: value}), DEVICE)
    message = str(caught.value)
    assert "\n" not in message and option.replace("_", "-") in message and "not of ray" in message


def test_options_become_task_resources() -> None:
    assert settings_from(EngineOptions(), "cuda").task_options() == {
        "num_gpus": 1.0,  # a CUDA device: one GPU per task unless told
        "num_cpus": 1.0,
        "max_calls": 1,  # a fresh worker per configuration
        "max_retries": 0,  # the driver retries a death, Ray does not
    }
    assert settings_from(EngineOptions(gpus_per_task=0.5, cpus_per_task=4), "cuda:1").task_options()["num_gpus"] == 0.5
    assert settings_from(EngineOptions(), DEVICE).gpus_per_task == 0
    with pytest.raises(InputError, match="max_parallel >= 1"):
        RaySettings(max_parallel=0)


def test_a_task_no_node_can_hold_is_refused_on_an_own_cluster_and_waits_on_a_joined_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    asks_a_gpu = RaySettings(gpus_per_task=1.0)
    with pytest.raises(InputError, match=r"^each Ray task asks for 1 GPU, more than the cluster has \(2 CPU\)"):
        check_fits(asks_a_gpu, {"CPU": 2.0}, own_cluster=True)
    check_fits(asks_a_gpu, {"CPU": 2.0}, own_cluster=False)
    assert "the tasks wait until the cluster grows" in caplog.text


@pytest.mark.parametrize(
    ("error", "why"),
    [
        (ray.exceptions.WorkerCrashedError(), "its Ray worker died (killed, crashed, or stopped by the host's OOM"),
        (
            ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.\nx"),
            "memory monitor",
        ),
        (ray.exceptions.NodeDiedError("node 1 died"), "the Ray node running it died"),
        (ray.exceptions.TaskUnschedulableError("no node"), "Ray could not schedule it"),
        (ray.exceptions.TaskCancelledError(), "it was cancelled"),
        (ray.exceptions.RaySystemError("lost the GCS\nmore"), "RaySystemError: System error: lost the GCS"),
    ],
)
def test_each_death_reads_as_one_line_and_never_as_a_device_bound(error: Exception, why: str) -> None:
    death = death_of(error)
    assert why in death.reason and "\n" not in death.reason
    assert death.reason.startswith("the Ray task ended without a record: ")
    assert "bound" not in death.reason and "out of memory" not in death.reason.lower()
