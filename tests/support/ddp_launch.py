"""Starting torchrun from the tests: one launch shared by every two-rank check (tests/launch/ddp_suite.py),
DDP's and FSDP2's (fsdp_agreement.py, fsdp_find.py). The scripts the tests start live in ``LAUNCH``.

``ddp_output(check, tmp_path_factory)`` starts the shared launch the first time a test asks (once
per pytest run, also under pytest-xdist), then returns the folder that ``check`` wrote to, or fails
the calling test with that check's own traceback from the rank where it failed. Paths come from
``tmp_path_factory`` and the port is a free one: neither workers nor parallel runs collide.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock  # installed with torch

# Cheapest first; Lightning last, as it owns the process group it finds for the rest of the launch.
CHECKS = (
    "ddp_accumulation",
    "ddp_agreement",
    "ddp_raised_trial",
    "ddp_noise",
    "ddp_sweep",
    "fsdp_agreement",
    "fsdp_find",
    "fsdp_own_workload",
    "ddp_lightning",
)
LAUNCH_TIMEOUT_SECONDS = 300
LAUNCH = Path(__file__).resolve().parents[1] / "launch"  # tests/launch/: the scripts started as processes

_launched: dict[str, Path] = {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(
    script: str, *arguments: str, env: dict[str, str] | None = None, ranks: int = 2
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=RANKS tests/launch/SCRIPT ARGUMENTS...`` on the loopback, output captured."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(LAUNCH / script),
        *arguments,
    ]
    env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": "lo"}  # loopback: the hostname may not route
    return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_SECONDS, env=env)


def _launch(out: Path) -> None:
    """Run every available check in one launch into ``out``; how the launch ended goes to ``ending.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    checks = [c for c in CHECKS if c != "ddp_lightning" or importlib.util.find_spec("lightning") is not None]
    try:
        completed = torchrun("ddp_suite.py", str(out), *checks, env={"BATCHFIT_CACHE_DIR": str(out / "cache")})
        ending = f"torchrun exited with {completed.returncode}; its stderr ends:\n{completed.stderr[-3000:]}"
    except subprocess.TimeoutExpired as expired:
        ending = f"torchrun timed out after {LAUNCH_TIMEOUT_SECONDS} s; its stderr ends:\n{str(expired.stderr)[-3000:]}"
    (out / "ending.txt").write_text(ending)


def _shared_launch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The launch's folder. Under pytest-xdist the workers of one run share it (the first to ask
    launches, under a lock, in the run's own temporary folder); alone, it is this run's."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp("ddp_suite")
        _launch(out)
        return out
    shared = tmp_path_factory.getbasetemp().parent  # one per run, shared by its workers
    with FileLock(str(shared / "ddp_suite.lock")):
        out = shared / "ddp_suite"
        if not (out / "ending.txt").exists():
            _launch(out)
    return out


def ddp_output(check: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder ``check`` (a ``ddp_*.py`` script's name) wrote to in the shared launch."""
    if "suite" not in _launched:
        _launched["suite"] = _shared_launch(tmp_path_factory)
    out = _launched["suite"]
    ending = (out / "ending.txt").read_text()
    for rank in (0, 1):
        path = out / f"status.{rank}.json"
        status = json.loads(path.read_text()) if path.exists() else {}
        if check not in status:
            failed = [name for name, outcome in status.items() if outcome != "ok"]
            before = f"{failed[0]} failed before it" if failed else "the launch failed or timed out"
            pytest.fail(f"{check} did not run to its end on rank {rank}: {before}; {ending}")
        if status[check] != "ok":
            pytest.fail(f"{check} failed on rank {rank}:\n{status[check]}")
    return out / check
