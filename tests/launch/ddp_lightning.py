"""Run for test_lightning.py under torchrun (2 ranks, gloo; by ddp_suite.py with the other checks,
or alone): Lightning DDP on the CPU with BatchFit.

Rank 1's simulated device is smaller: both ranks must set the size that fits on rank 1, keep the
global batch of 3000 through accumulation, and then train two optimizer steps at that size."""

import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

import batchfit as bf
from batchfit.integrations.lightning import LOOP_HEADROOM
from batchfit.integrations.lightning import BatchFit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from lightning_models import Classifier
from lightning_models import sample
from lightning_models import trainer

CAPACITIES = {0: "6MiB", 1: "5MiB"}


def alone(capacity: str) -> int:
    """The size a single process finds on this capacity, without agreement."""
    module = Classifier()
    optimizer = torch.optim.Adam(module.net.parameters(), lr=1e-3)
    workload = bf.Workload(module.net, sample(), F.cross_entropy, optimizer, keep_output=False)  # training_step's loop
    return bf.search_workload(
        workload, device=bf.SimulatedDevice(capacity), agree=False, margin=LOOP_HEADROOM
    ).batch_size


def main() -> None:
    out = Path(sys.argv[1])
    module = Classifier()
    fitter = trainer(devices=2, strategy="ddp", max_steps=2)
    rank = fitter.global_rank
    callback = BatchFit(global_batch_size=3000, device=bf.SimulatedDevice(CAPACITIES[rank]))
    fitter.callbacks.append(callback)
    fitter.fit(module)
    report = {
        "batch_size": callback.result.micro_batch_size,
        "largest": callback.result.one_step_search.batch_size,
        "accumulate": fitter.accumulate_grad_batches,
        "rows_seen": module.rows_seen,
        "rank0_alone": alone(CAPACITIES[0]),
        "rank1_alone": alone(CAPACITIES[1]),
    }
    Path(f"{out}.{rank}").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
