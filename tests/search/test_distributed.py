"""Agreement across ranks: torchrun with 2 gloo ranks where only rank 1 has the smaller device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import batchfit as bf
from batchfit.search.distributed import _merge
from batchfit.search.trial import Trial
from ddp_launch import LAUNCH
from ddp_launch import ddp_output
from ddp_launch import free_port
from models import decoder

# The torchrun checks (ddp_agreement.py, ddp_raised_trial.py, ddp_sweep.py, ddp_noise.py) run in one
# launch shared with test_accumulate.py's and test_lightning.py's (ddp_suite.py); each test reads its
# check's output. The check that leaves a rank behind (ddp_dead_rank.py) starts its own two processes:
# its process group cannot be used after that.

AGREEMENT_TIMEOUT_SECONDS = 5  # how long a rank waits in an agreement for a rank that stopped


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_ranks_agree_on_the_size_and_shrink_together(tmp_path_factory):
    out = ddp_output("ddp_agreement", tmp_path_factory) / "out"
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


def _start_two_ranks(script: str, *arguments: str) -> list[subprocess.Popen]:
    """``tests/launch/SCRIPT ARGUMENTS...`` as ranks 0 and 1 of a gloo group (env:// rendezvous, no
    torchrun: no agent stops a rank when the other fails), agreeing with a 5 s timeout."""
    base = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "BATCHFIT_AGREEMENT_TIMEOUT_SECONDS": str(AGREEMENT_TIMEOUT_SECONDS),
    }
    path = str(LAUNCH / script)
    return [
        subprocess.Popen(
            [sys.executable, path, *arguments],
            env={**base, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]


def _exit_codes(ranks: list[subprocess.Popen]) -> list[int]:
    try:
        return [process.wait(timeout=120) for process in ranks]
    finally:
        for process in ranks:
            process.kill()


@pytest.mark.slow  # two processes and a timeout; the agreement itself stays in make test
def test_a_rank_that_dies_makes_the_other_fail_clearly_within_the_timeout(tmp_path):
    out = tmp_path / "dead.json"
    codes = _exit_codes(_start_two_ranks("ddp_dead_rank.py", str(out)))
    assert codes[1] == 3
    outcome = json.loads(out.read_text())
    assert (
        outcome["error"] is not None and "batchfit: a rank did not reach the batch-size agreement" in outcome["error"]
    )
    assert outcome["seconds"] < 60


@pytest.mark.slow  # its own torchrun launch and a 5 s agreement timeout: about 10 s
def test_a_rank_that_hangs_is_named_and_the_job_ends():
    """Rank 1 sleeps inside a trial; rank 0 names it within the timeout and ends with status 1 instead of hanging
    at its exit (its process group waits there for the collective rank 1 never joins), so torchrun ends the job:
    it used to run until killed."""
    from ddp_launch import torchrun

    started = time.perf_counter()
    completed = torchrun("ddp_hung_rank.py", env={"BATCHFIT_AGREEMENT_TIMEOUT_SECONDS": "5"})
    assert completed.returncode != 0 and time.perf_counter() - started < 60
    assert "rank 1 stopped agreeing" in completed.stderr


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_a_trial_that_raises_on_one_rank_stops_the_others_at_once_naming_it(tmp_path_factory):
    out = ddp_output("ddp_raised_trial", tmp_path_factory) / "out"
    first, second = json.loads(out.read_text())
    named = "RankStoppedError: batchfit: rank {}'s trial of batch size 8 raised ValueError (a bad batch of 8 on rank {}), so rank {} stops"
    assert first["zero"] == "ValueError: a bad batch of 8 on rank 0"  # the raising rank's own error propagates
    assert second["zero"].startswith(named.format(0, 0, 1))
    assert first["one"].startswith(named.format(1, 1, 0))
    assert second["one"] == "ValueError: a bad batch of 8 on rank 1"
    assert first["both"] == "ValueError: a bad batch of 8 on rank 0" and second["both"].endswith("on rank 1")
    assert first["none"] == second["none"] == "fits, peak 101"  # still in step: the worst peak of both ranks
    # A real search whose loss raises on one rank from batch size 8 on: that rank's own error, and the
    # other rank stops at once naming it (before: it waited for gloo's 30-minute timeout).
    for raiser, key in ((0, "find_zero"), (1, "find_one")):
        mine, theirs = (first, second)[raiser][key], (first, second)[1 - raiser][key]
        assert mine.startswith("ValueError: a bad batch of ") and mine.endswith(f"on rank {raiser}")
        assert theirs.startswith(f"RankStoppedError: batchfit: rank {raiser}'s trial of batch size ")
    # A Microbatcher step whose loss raises on rank 0 (no OOM): rank 1 hears it in that step's agreement.
    assert first["step_zero"] == "ValueError: bad targets on rank 0"
    assert second["step_zero"].startswith("RankStoppedError: batchfit: another rank's training step raised")
    assert first["step_none"] == second["step_none"] == "trained"


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_a_sweep_under_torchrun_agrees_writes_once_and_caches(tmp_path_factory):
    folder = ddp_output("ddp_sweep", tmp_path_factory)
    out = folder / "out"
    first, second = (json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1))
    alone = bf.sweep_grid(decoder, {"seq_len": [8, 16]}, device="sim:768KiB", cache=False, log=lambda line: None)
    expected = [r["batch_size_used"] for r in alone.records]  # what fits on the smaller device
    assert first[0]["sizes"] == second[0]["sizes"] == expected
    assert first[0]["starts"] == second[0]["starts"]  # the same estimate on both ranks
    assert first[0]["trials"] == second[0]["trials"] > 0
    assert first[1] == second[1] and first[1]["trials"] == 0 and first[1]["sizes"] == expected  # all from the cache
    saved = json.loads((folder / "first.json").read_text())
    assert saved["device"]["name"] == "sim:1.0MiB"  # written by rank 0 only
    assert [r["batch_size_used"] for r in saved["summary"]] == expected


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_the_noise_scale_over_two_ranks_equals_two_micro_batches_on_one(tmp_path_factory):
    from torch.nn import functional as F

    from noise_data import loader
    from noise_data import regression

    out = ddp_output("ddp_noise", tmp_path_factory) / "out"
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    model, inputs, targets = regression()
    alone = bf.measure_noise_scale(model, loader(inputs, targets, 16), loss_fn=F.mse_loss, steps=40, micro_batch_size=8)
    for measured in [rank[way] for rank in ranks for way in ("active", "passive")]:
        assert (measured["small_batch_size"], measured["big_batch_size"]) == (8, 16)
        for key in ("b_simple", "grad_norm_sq", "trace_sigma"):
            assert measured[key] == pytest.approx(getattr(alone, key), rel=1e-9), key
