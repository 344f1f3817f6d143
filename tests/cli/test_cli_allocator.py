"""``batchfit allocator SNAPSHOT``, and ``--memory-snapshot FILE`` on ``find`` and ``estimate``: batchfit's runs
written as PyTorch memory snapshots, and a snapshot replayed through the caching allocator model."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest
import torch

import batchfit as bf
from batchfit.cli.snapshot_trials import snapshot_trial
from batchfit.devices.memory_snapshots import write_snapshot
from cli_runner import invoke
from user_loops import FiveLinears
from user_loops import loss_fn


@pytest.fixture(scope="module")
def five_linears_file(tmp_path_factory):
    """Five linear layers at 222 rows on 3.1 MiB: the loop the allocator model runs on fails at step 8."""
    case = FiveLinears()
    model, sample, optimizer = case.build()
    device = bf.SimulatedDevice(case.capacity_bytes(), allocator="cuda")
    path = tmp_path_factory.mktemp("snapshots") / "five_linears.pickle"
    write_snapshot(snapshot_trial(bf.Workload(model, sample, loss_fn, optimizer), 222, device), path)
    return path


def lines(result) -> list[str]:
    return result.stdout.strip().splitlines()


def test_the_allocator_command_reports_a_replay_that_matched(five_linears_file, tmp_path):
    out = tmp_path / "replay.json"
    result = invoke("allocator", str(five_linears_file), "--json", str(out))
    assert result.exit_code == 0, result.output
    text = lines(result)
    assert text[0].startswith(f"batchfit allocator: {five_linears_file}: ") and "capacity 3.1 MiB" in text[0]
    assert text[1].startswith("Replay: matched event by event") and "ran out of memory (event" in text[1]
    assert any(line.startswith("Fragmentation at the peak: 2.0 MiB reserved") for line in text)
    assert any(line.startswith("Out of memory: the request at event") for line in text)
    assert any(line.strip().startswith("expandable_segments:True would") for line in text)
    assert text[-1].startswith("Largest batch the replay suggests: ")  # the batch batchfit noted: 222
    assert "(recorded at 222;" in text[-1]
    document = json.loads(out.read_text())
    assert document["matched"] and document["card_ooms"] == document["model_ooms"] != []
    assert document["capacity_bytes"] == 3_296_634 and len(document["what_if"]) == 3


def test_other_settings_and_a_capacity_can_be_given(five_linears_file):
    result = invoke(
        "allocator", str(five_linears_file), "--settings", "expandable_segments:True", "--capacity", "64MiB",
        "--try", "max_split_size_mb:20", "--batch-size", "100",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = lines(result)
    assert "settings cuda-expandable (from given)" in text[0] and "capacity 64.0 MiB (from given)" in text[0]
    assert text[1].startswith("Replay: differs from the card:")
    assert "(recorded at 100;" in text[-1]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"certainly not a pickle\n", "does not unpickle"),
        (pickle.dumps({"segments": [], "traces": []}), "it has no device_traces"),
        (pickle.dumps([1, 2, 3]), "it holds a list"),
        (pickle.dumps(bf.SimulatedDevice), "does not unpickle"),  # names a class: refused, nothing imported or run
    ],
    ids=["not-a-pickle", "no-trace", "a-list", "a-class"],
)
def test_a_file_that_is_not_a_snapshot_is_one_line_with_exit_code_2(tmp_path, content, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    result = invoke("allocator", str(path))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "is not a memory snapshot" in result.stderr and message in result.stderr


def test_a_missing_file_is_one_line_with_exit_code_2(tmp_path):
    result = invoke("allocator", str(tmp_path / "nowhere.pickle"))
    assert result.exit_code == 2 and result.stderr.count("\n") == 1


def test_the_allocator_help_loads_no_torch():
    code = (
        "import sys\nfrom batchfit.cli.app import app\ntry:\n    app(['allocator', '--help'])\n"
        "except SystemExit:\n    pass\nprint('LOADED', 'torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip().splitlines()[-1] == "LOADED False"
    assert "--memory-snapshot" in invoke("find", "--help").output
    assert "--memory-snapshot" in invoke("estimate", "--help").output


# -- writing snapshots from the command line --------------------------------------------------------------------


def test_find_writes_the_answers_trial_as_a_snapshot_that_replays(tmp_path):
    from torch.cuda import _memory_viz

    path = tmp_path / "find.pickle"
    result = invoke("find", "mlp", "--device", "sim:16MiB:cuda", "--memory-snapshot", str(path))
    assert result.exit_code == 0, result.output
    written = result.stdout.replace("\n", " ")
    assert f"Wrote {path}: the memory snapshot of batch size" in written
    answer = int(written.split("the memory snapshot of batch size ")[1].split()[0])
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["batchfit"]["device"] == "sim:16.0MiB:cuda" and snapshot["batchfit"]["batch_size"] == answer
    assert "<!DOCTYPE html>" in _memory_viz.segment_plot(snapshot)
    replayed = invoke("allocator", str(path))
    assert replayed.exit_code == 0 and lines(replayed)[1].startswith("Replay: matched event by event")


def test_estimate_writes_the_traced_trial_as_a_snapshot_that_replays(tmp_path):
    path = tmp_path / "estimate.pickle"
    result = invoke("estimate", "mlp", "--gpu", "a100-40gb", "--batch-size", "4096", "--memory-snapshot", str(path))
    assert result.exit_code == 0, result.output
    snapshot = pickle.loads(path.read_bytes())
    about = snapshot["batchfit"]
    assert about["batch_size"] == 4096 and about["device"] == "trace:a100-40gb" and about["allocator"] == "cuda"
    assert any(s["segment_type"] == "large" for s in snapshot["segments"])
    replayed = invoke("allocator", str(path))
    assert replayed.exit_code == 0 and lines(replayed)[1].startswith("Replay: matched event by event")
    assert "(recorded at 4096;" in lines(replayed)[-1]


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["find", "mlp", "--device", "sim:16MiB"], "--memory-snapshot needs the CUDA caching allocator"),
        (["find", "mlp", "--device", "cpu"], "--memory-snapshot needs the CUDA caching allocator"),
        (["estimate", "mlp", "--capacity", "1GiB"], "an estimate with --allocator cuda"),
        (["find", "mlp", "--device", "sim:16MiB:cuda", "--gpus", "2"], "not with --gpus"),
    ],
    ids=["sim-exact", "cpu", "estimate-exact", "sharded"],
)
def test_a_snapshot_nothing_can_write_is_refused_before_the_search(tmp_path, command, message):
    result = invoke(*command, "--memory-snapshot", str(tmp_path / "s.pickle"))
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "s.pickle").exists() and "Trial" not in result.stdout


def test_a_snapshot_to_standard_output_is_refused(tmp_path):
    result = invoke("find", "mlp", "--device", "sim:16MiB:cuda", "--memory-snapshot", "-")
    assert result.exit_code == 2 and "give it a file path" in result.stderr


def test_torch_is_the_reader_of_record():
    """The fields written are the ones torch's own snapshot has (torch.cuda.memory._snapshot documents them)."""
    doc = torch.cuda.memory._snapshot.__doc__
    for name in ("total_size", "segment_type", "requested_size", "device_traces", "free_completed", "device_free"):
        assert name in doc
