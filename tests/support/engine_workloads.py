"""Workloads a sweep's worker processes build by name (tests/support is on their PYTHONPATH in the tests)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import batchfit as bf
from batchfit.step.builtin_workloads import gpt_tiny

MARKER_VARIABLE = "BATCHFIT_TEST_DIE_ONCE"  # a folder: the first process to reach a second real loss dies
_losses = 0


class DiesOnce:
    """``loss_fn`` that SIGKILLs its own process at the second loss it computes (mid-search: one trial has
    finished), the first time in the folder ``$BATCHFIT_TEST_DIE_ONCE``; later processes run as usual."""

    def __init__(self, loss_fn: Any, seq_len: int):
        self.loss_fn, self.seq_len = loss_fn, seq_len

    def __call__(self, output: Any, batch: Any) -> Any:
        global _losses
        _losses += 1
        folder = os.environ.get(MARKER_VARIABLE)
        if folder and _losses == 2:
            marker = Path(folder) / f"died-{self.seq_len}"
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        return self.loss_fn(output, batch)


def gpt_faulty(seq_len: int, dies_at: int = 0, raises_at: int = 0) -> bf.Workload:
    """``gpt_tiny`` at ``seq_len``; at ``dies_at`` its process is killed mid-search once (see ``DiesOnce``), at
    ``raises_at`` the factory raises (a user's bug)."""
    if seq_len == raises_at:
        raise ValueError("no such configuration in this model")
    workload = gpt_tiny(seq_len=seq_len, sample_size=2)
    if seq_len == dies_at:
        workload.loss_fn = DiesOnce(workload.loss_fn, seq_len)
    return workload
