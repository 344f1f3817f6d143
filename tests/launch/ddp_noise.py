"""Run for test_distributed.py under torchrun (2 ranks, gloo; by ddp_suite.py with the other checks,
or alone): each rank's local gradient is one small batch, the global batch the big one, so the
estimate equals one process with 2 micro-batches, actively (measure_noise_scale) and passively
(GradientAccumulator(noise=...) over DDP)."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import batchfit as bf
from batchfit.planning.noise import NoiseScaleEstimator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from noise_data import loader
from noise_data import regression


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, inputs, targets = regression()
    halves = ((x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]) for x, y in loader(inputs, targets, 16))
    ddp = DistributedDataParallel(model)
    noise = bf.measure_noise_scale(ddp, halves, loss_fn=F.mse_loss, steps=40)
    estimator = NoiseScaleEstimator()  # passively, inside gradient accumulation over DDP
    accumulator = bf.GradientAccumulator(
        ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), loss_fn=F.mse_loss, micro_batch_size=8, noise=estimator
    )
    again = ((x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]) for x, y in loader(inputs, targets, 16))
    for _ in range(40):
        accumulator.step(next(again))
    results = {"active": noise.to_dict(), "passive": estimator.result().to_dict()}
    Path(f"{sys.argv[1]}.{rank}").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
