"""Sweeps fanned out on the local engine: each configuration in a fresh process, the same answers as the
sequential sweep, a worker killed mid-search sent again (never an out-of-memory bound), a factory that raises
recorded while the sweep goes on; the driver's schedule (extremes first) and its job ids beside the file."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

from batchfit.errors import InputError
from batchfit.search.settings import SearchSettings
from batchfit.sweep.api import grid_configs
from batchfit.sweep.api import sweep_grid
from batchfit.sweep.engines import EngineOptions
from batchfit.sweep.engines import check_engine
from batchfit.sweep.engines import options
from batchfit.sweep.engines.local import LocalEngine
from batchfit.sweep.engines.local import plan_slots
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import JobSettings
from batchfit.sweep.jobs import MainFunction
from batchfit.sweep.jobs import portable
from batchfit.sweep.jobs import run_job
from batchfit.sweep.parallel import JobTokens
from batchfit.sweep.parallel import ParallelSweep
from batchfit.sweep.results import SweepFile
from batchfit.sweep.results import SweepResult
from batchfit.sweep.schedule import extremes_first
from engine_checks import InProcessEngine
from engine_workloads import MARKER_VARIABLE
from engine_workloads import gpt_faulty

SUPPORT = Path(__file__).resolve().parents[1] / "support"
DEVICE = "sim:12MiB"
ANSWER = ("batch_size_used", "fits", "exact", "peak_bytes", "held_bytes", "limit_bytes")


@pytest.fixture
def workers_import_the_tests(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))


def _answers(records):
    return {r["seq_len"]: {k: r.get(k) for k in ANSWER} for r in records}


@pytest.mark.slow  # four worker processes, each starting Python and torch: about 12 s (make reliability)
def test_a_killed_worker_is_sent_again_and_the_answers_are_the_sequential_ones(
    tmp_path, monkeypatch, workers_import_the_tests
):
    inline = sweep_grid(gpt_faulty, {"seq_len": [8, 16, 32]}, device=DEVICE, cache=False, engine="inline")
    monkeypatch.setenv(MARKER_VARIABLE, str(tmp_path))
    lines: list[str] = []
    results = tmp_path / "sweep.json"
    local = sweep_grid(
        gpt_faulty,
        {"seq_len": [8, 16, 32], "dies_at": [16]},
        device=DEVICE,
        cache=False,
        engine="local",
        engine_options={"workers": 2},
        results_path=results,
        log=lines.append,
    )
    assert _answers(local.records) == _answers(inline.records)
    assert all(r["exact"] for r in local.records)
    # The extremes went first (8 and 32), then 16, started from the memory model fitted across them.
    sent = [line.split("Sent seq_len=")[1].split(",")[0] for line in lines if "Sent " in line]
    assert sent == ["8", "32", "16", "16"]
    # 16's first process was killed at its second loss, mid-search; it ran again in a new process.
    assert (tmp_path / "died-16").is_file()
    assert [line.split("] ", 1)[1] for line in lines if "died:" in line] == [
        "✗ The worker for seq_len=16, dies_at=16 died: killed by SIGKILL (the host's out-of-memory killer, or a kill)"
    ]
    by_len = {r["seq_len"]: r for r in local.records}
    assert [by_len[n]["ran_on"]["attempt"] for n in (8, 16, 32)] == [1, 2, 1]
    assert by_len[16]["estimate_source"] == "model"
    # The file holds every record as it arrived; no job ids are left beside it.
    assert [r["seq_len"] for r in json.loads(results.read_text())["summary"]][2] == 16
    assert not results.with_name("sweep.json.jobs.json").exists()
    assert "Ran on the local engine: worker 1" in local.summary()


def test_the_driver_sends_extremes_first_retries_a_death_once_and_records_what_raised():
    """The driver with an engine that runs each job in this process (the slow test above kills a real worker)."""
    grid = {"seq_len": [8, 16, 24, 32], "raises_at": [24]}
    configs = grid_configs(grid)
    engine = InProcessEngine(dies=("seq_len=16, raises_at=24",))
    settings = JobSettings(SearchSettings(), True, ("model", "trace", "rules"), None)
    names = tuple(grid)

    def make_job(knobs, records):
        return ConfigJob(knobs, gpt_faulty, DEVICE, settings, names, records)

    lines: list[str] = []
    header = {"workload": "gpt_faulty", "knobs": list(names), "device": {"name": DEVICE}, "settings": {}}
    result = ParallelSweep(engine, make_job, None, lines.append).run(configs, SweepFile(None, header))
    sent = [line.split("Sent seq_len=")[1].split(",")[0] for line in lines if "Sent " in line]
    assert sent == ["8", "32", "16", "24", "16"]  # the extremes, then the rest; 16 again after its death
    assert [line for line in lines if "died:" in line] == [
        "[slot 1] ✗ The worker for seq_len=16, raises_at=24 died: "
        "killed by SIGKILL (the host's out-of-memory killer, or a kill)"
    ]
    by_len = {r["seq_len"]: r for r in result.records}
    inline = sweep_grid(gpt_faulty, {"seq_len": [8, 16, 32]}, device=DEVICE, cache=False, engine="inline")
    assert _answers([by_len[n] for n in (8, 16, 32)]) == _answers(inline.records)
    assert [by_len[n]["ran_on"]["attempt"] for n in (8, 16, 32)] == [1, 2, 1]
    assert by_len[16]["estimate_source"] == "model"  # fitted across the extremes
    assert (by_len[24]["failure"], by_len[24]["error"]) == ("raised", "ValueError: no such configuration in this model")
    assert result.ran_on == {"engine": "in-process", "slots": {"slot 1": 2, "slot 2": 2}}  # one record each


def test_a_factory_that_raises_is_recorded_and_the_job_goes_on():
    """What every engine's worker runs: the configuration's own error becomes its record (the driver's retry is for
    deaths only, and a later run of the sweep measures it again)."""
    settings = JobSettings(SearchSettings(), True, ("trace",), None)
    outcome = run_job(
        ConfigJob({"seq_len": 24, "raises_at": 24}, gpt_faulty, DEVICE, settings, ("seq_len", "raises_at"))
    )
    record = outcome.record
    assert (record["failure"], record["batch_size_used"], record["fits"]) == ("raised", None, False)
    assert record["error"] == "ValueError: no such configuration in this model"
    assert outcome.log == ["✗ seq_len=24, raises_at=24 raised ValueError: no such configuration in this model"]
    summary = SweepResult([{**record, "ran_on": {}}], ["seq_len", "raises_at"], DEVICE, None).summary()
    assert summary.endswith("No answer (raised or died; run again to retry): seq_len=24, raises_at=24.")


def test_extremes_go_first_and_job_ids_outlive_the_driver(tmp_path):
    ordered, corners = extremes_first([{"seq_len": s, "attn": a} for s in (8, 16, 32) for a in ("sdpa", "eager")])
    assert corners == 4
    assert [(c["seq_len"], c["attn"]) for c in ordered[:4]] == [(8, "sdpa"), (8, "eager"), (32, "sdpa"), (32, "eager")]
    tokens = JobTokens(tmp_path / "sweep.json")
    tokens.set({"seq_len": 8}, "1234_0")
    assert JobTokens(tmp_path / "sweep.json").get({"seq_len": 8}) == "1234_0"  # a new driver reads it
    tokens.set({"seq_len": 8}, None)
    assert not (tmp_path / "sweep.json.jobs.json").exists()


def test_engines_refuse_what_they_cannot_do(monkeypatch):
    with pytest.raises(InputError, match="unknown engine 'mpi': choose from inline, local, slurm, ray"):
        check_engine("mpi")
    monkeypatch.setitem(options.EXTRAS, "ray", "batchfit_no_such_module")
    with pytest.raises(
        InputError, match=r"the ray engine needs batchfit_no_such_module: pip install 'batchfit\[ray\]'"
    ):
        check_engine("ray")
    with pytest.raises(InputError, match="--slots \\(devices\\) or --workers"):
        plan_slots(EngineOptions(slots=("cuda:0",), workers=2), "cuda")
    with pytest.raises(InputError, match="slot 'cpu' is not a CUDA device"):
        plan_slots(EngineOptions(slots=("cpu",)), "cuda")
    with pytest.raises(InputError, match="--partition is for the slurm or ray engine"):
        LocalEngine.make(EngineOptions(partition="gpu"), DEVICE)
    assert [label for label, _ in plan_slots(EngineOptions(slots=("cuda:1", "cuda:3")), "cuda")] == ["cuda:1", "cuda:3"]
    with pytest.raises(InputError, match="cannot be sent to another process"):
        portable(lambda seq_len: None, "factory")
    with pytest.raises(InputError, match="engine_options are for the local, slurm or ray engine"):
        sweep_grid(gpt_faulty, {"seq_len": [8]}, device=DEVICE, engine="inline", engine_options={"workers": 2})


SCRIPT = r"""
import sys
import batchfit as bf
from batchfit.step.builtin_workloads import gpt_tiny

with open("imports.txt", "a") as imports:  # a worker imports this file for its factory: this runs there too
    imports.write("imported\n")


def make(seq_len):
    return gpt_tiny(seq_len=seq_len, sample_size=2)


if __name__ == "__main__":  # the driver only
    open("runs.txt", "a").write("ran\n")
    result = bf.sweep_grid(make, {"seq_len": [8]}, device="sim:12MiB", cache=False, engine="local",
                           engine_options={"workers": 1}, log=print)
    print("answer", result.records[0]["batch_size_used"], result.records[0]["ran_on"]["engine"])
"""


@pytest.mark.slow  # the script and its worker each start Python and torch: about 7 s (make reliability)
def test_a_factory_of_the_users_own_script_runs_in_the_worker_without_running_the_script_again(tmp_path):
    script = tmp_path / "my_sweep.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    inline = sweep_grid(gpt_faulty, {"seq_len": [8]}, device=DEVICE, cache=False, engine="inline")
    assert f"answer {inline.records[0]['batch_size_used']} local" in done.stdout
    assert (tmp_path / "imports.txt").read_text() == "imported\n" * 2  # the driver, then the worker for the factory
    assert (tmp_path / "runs.txt").read_text() == "ran\n"  # the guarded part ran once: not again in the worker


def test_a_function_of_the_main_script_is_sent_by_its_file_and_imported_once(tmp_path, monkeypatch):
    """What the worker does with a factory of the script run as ``__main__`` (the slow test above runs it for real)."""
    script = tmp_path / "my_sweep.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(SCRIPT.replace('if __name__ == "__main__":', "if False:"), str(script), "exec"), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    make = main.make
    make.__module__ = "__main__"
    sent = portable(make, "factory")
    assert sent == MainFunction(str(script.resolve()), "make")
    again = pickle.loads(pickle.dumps(sent))  # as the worker gets it
    assert again(seq_len=8).model is not again(seq_len=8).model  # a new workload per call
    assert (tmp_path / "imports.txt").read_text() == "imported\n" * 2  # our exec, then one import for both calls
    assert not (tmp_path / "runs.txt").exists()  # the guarded part never ran
