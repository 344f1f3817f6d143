"""Agreement across ranks: torchrun with 2 gloo ranks where only rank 1 has the smaller device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.distributed import _merge
from batchfit.trial import Trial


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: str, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(Path(__file__).with_name(script)), str(out)]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # loopback only: the sandbox's hostname may not route
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)


def test_ranks_agree_on_the_size_and_shrink_together(tmp_path):
    out = tmp_path / "agreement.json"
    completed = torchrun("ddp_agreement.py", out)
    assert completed.returncode == 0, completed.stderr[-3000:]
    first, second = json.loads(out.read_text())
    assert first["found"] == second["found"] >= 16  # the same answer on both ranks: what fits on the smaller
    assert first["micro"] == second["micro"] == 16  # rank 0 had room for 64 but shrank with rank 1
    assert first["ooms"] == second["ooms"] == 2  # 64 and 32 failed on rank 1, and both replayed
    assert max(first["difference"], second["difference"]) < 1e-10  # still the full batch's step


def test_merging_trials_keeps_the_worst_case():
    fit = Trial(8, True, 100, 0.1, phase_peak_bytes={"backward": 100}, steps=2, timeline=(10, 100))
    tight = Trial(8, True, 120, 0.2, phase_peak_bytes={"backward": 120}, steps=2, timeline=(20, 90))
    failed = Trial(8, False, None, 0.3, "out of memory", {"forward": 50}, 0, oom=True, failed_phase="forward")
    merged = _merge([fit, tight])
    assert merged.fits and merged.peak_bytes == 120 and merged.timeline == (20, 100) and merged.seconds == 0.2
    worst = _merge([fit, failed])
    assert not worst.fits and worst.oom and worst.failed_phase == "forward" and worst.peak_bytes is None
    pytest.importorskip("torch.distributed")


def test_a_rank_that_dies_makes_the_other_fail_clearly_within_the_timeout(tmp_path):
    out = tmp_path / "dead.json"
    script = str(Path(__file__).with_name("ddp_dead_rank.py"))
    base = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": "2", "BATCHFIT_AGREEMENT_TIMEOUT_SECONDS": "5"}  # fmt: skip
    ranks = [subprocess.Popen([sys.executable, script, str(out)], env={**base, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]  # fmt: skip
    try:
        codes = [process.wait(timeout=120) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    assert codes[1] == 3
    outcome = json.loads(out.read_text())
    assert (
        outcome["error"] is not None and "batchfit: a rank did not reach the batch-size agreement" in outcome["error"]
    )
    assert outcome["seconds"] < 60
