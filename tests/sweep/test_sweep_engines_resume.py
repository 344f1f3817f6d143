"""The driver of a sweep on the local engine killed with SIGKILL mid-sweep: its workers die with it (none is
left holding a device), and the same command run again sends only the configurations still missing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parents[1] / "support"
GRID = ["--grid", "seq_len=8,12,16,24,32", "--grid", "dies_at=0"]


def _command(results: Path) -> list[str]:
    factory = f"{SUPPORT / 'engine_workloads.py'}:gpt_faulty"
    batchfit = str(Path(sys.executable).with_name("batchfit"))
    engine = ["--engine", "local", "--workers", "2", "--no-cache", "--json", str(results)]
    return [batchfit, "sweep", factory, *GRID, "--device", "sim:12MiB", *engine]


def _records(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["summary"]
    except (OSError, ValueError, KeyError):
        return []


def _workers_alive(driver_pid: int) -> list[int]:
    """Processes running batchfit.sweep.worker whose parent was ``driver_pid`` or that outlived it (orphans)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = status.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"batchfit.sweep.worker" in command:
            found.append(int(status.parent.name))
    return found


@pytest.mark.slow  # two sweeps of five configurations, each in its own process: about 25 s (make reliability)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a worker dies with its driver on Linux")
def test_a_killed_driver_leaves_no_worker_and_the_same_command_sends_only_what_is_missing(tmp_path):
    results = tmp_path / "sweep.json"
    environment = {**os.environ, "PYTHONPATH": str(SUPPORT)}
    driver = subprocess.Popen(_command(results), env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while len(_records(results)) < 2 and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.05)
    assert driver.poll() is None, "the kill should land mid-sweep"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    kept = _records(results)
    assert 2 <= len(kept) < 5
    deadline = time.monotonic() + 10
    while _workers_alive(driver.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _workers_alive(driver.pid) == []  # each worker got SIGKILL when its driver died
    again = subprocess.run(_command(results), env=environment, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    resumed = {
        int(line.split("seq_len=")[1].split(",")[0]) for line in again.stdout.splitlines() if "Already measured" in line
    }
    sent = {
        int(line.split("seq_len=")[1].split(",")[0]) for line in again.stdout.splitlines() if "Sent seq_len" in line
    }
    assert resumed == {r["seq_len"] for r in kept}
    assert sent == {8, 12, 16, 24, 32} - resumed  # only the missing ones ran
    final = _records(results)
    assert sorted(r["seq_len"] for r in final) == [8, 12, 16, 24, 32]
    assert final[: len(kept)] == kept  # what was written before the kill is kept as it was
    assert all(r["fits"] and r["exact"] for r in final)
