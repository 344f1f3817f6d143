"""Where ``--json`` writes: ``-`` is stdout (then stdout carries the document alone), a symlink is followed to its
target, a FIFO or a character device is written through and stays what it is, and a folder or a socket is refused
in one line before any work."""

from __future__ import annotations

import json
import os
import socket
import stat
import textwrap
import threading

import pytest

from cli_runner import invoke

PLAN = ("plan", "--micro-batch-size", "16", "--global-batch-size", "64")

# A workload whose every trial leaves a mark: a refused output must leave none.
MARKED = """
import pathlib
import torch
import batchfit as bf

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))

    def loss_fn(output, targets):
        pathlib.Path(__file__).with_name("trial.mark").touch()
        return torch.nn.functional.cross_entropy(output, targets)

    batch = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    return bf.Workload(model, batch, loss_fn, torch.optim.Adam(model.parameters()))
"""


@pytest.fixture
def marked(tmp_path):
    folder = tmp_path / "workload"
    folder.mkdir()
    (folder / "marked.py").write_text(textwrap.dedent(MARKED))
    return f"{folder / 'marked.py'}:make", folder / "trial.mark"


def find(workload: str, *args: str):
    return invoke("find", workload, "--device", "sim:300KiB", "--no-cache", "--max-trials", "3", *args)


def test_json_dash_puts_the_document_alone_on_stdout():
    result = invoke(*PLAN, "--json", "-")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["batch_configuration"]["gradient_accumulation_steps"] == 4
    assert "Batch plan" in result.stderr  # the human lines went to stderr
    again = invoke(*PLAN)  # and the next command's go to stdout again
    assert "Batch plan" in again.stdout


def test_find_json_dash_keeps_stdout_for_the_document(marked):
    workload, _ = marked
    result = find(workload, "--json", "-")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["batch_size"] >= 1
    assert "Wrote -" in result.stderr
    quiet = find(workload, "--json", "-", "--quiet")
    assert quiet.exit_code == 0, quiet.output
    assert json.loads(quiet.stdout)["batch_size"] == document["batch_size"]
    assert quiet.stderr.split()[-1] == str(document["batch_size"])  # --quiet's answer moved to stderr


def test_json_and_plot_cannot_both_be_stdout(marked):
    workload, mark = marked
    result = find(workload, "--json", "-", "--plot", "-")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --json - and --plot - both ask for standard output")
    assert not mark.exists()


def test_json_through_a_symlink_writes_its_target(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "plan.json").write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(store / "plan.json")
    result = invoke(*PLAN, "--json", str(link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert json.loads((store / "plan.json").read_text())["batch_configuration"]["total_batch_size"] == 64


def test_json_to_a_fifo_reaches_its_reader(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[str] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()
    result = invoke(*PLAN, "--json", str(fifo))
    reader.join(timeout=10)
    assert result.exit_code == 0, result.output
    assert json.loads(received[0])["batch_configuration"]["total_batch_size"] == 64
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_json_to_a_character_device_leaves_it_one(tmp_path):
    device = tmp_path / "null"  # a copy of /dev/null: a bug must never get to replace the real one
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError) as error:
        pytest.skip(f"cannot make a character device here ({error})")
    result = invoke(*PLAN, "--json", str(device))
    assert result.exit_code == 0, result.output
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_rdev == os.makedev(1, 3)


def test_a_folder_is_refused_in_one_line_before_any_work(tmp_path, marked):
    workload, mark = marked
    result = find(workload, "--json", str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: cannot write {tmp_path}: it is a folder")
    assert result.stderr.count("\n") == 1
    assert not mark.exists()


def test_a_socket_is_refused_in_one_line_before_any_work(tmp_path, marked):
    workload, mark = marked
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        result = find(workload, "--json", str(path))
        plan = invoke(*PLAN, "--json", str(path))
    for refused in (result, plan):
        assert refused.exit_code == 2
        assert refused.stderr.startswith(f"error: cannot write {path}: it is a socket; give a regular file path")
        assert refused.stderr.count("\n") == 1
    assert not mark.exists()
    assert "Batch plan" not in plan.stdout
