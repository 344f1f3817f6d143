"""Run for test_distributed.py under torchrun (2 ranks, gloo; by ddp_suite.py with the other checks,
or alone). Only rank 1 has the small device: both ranks must find the same batch size, and the
Microbatcher must shrink on both."""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import batchfit as bf
from batchfit.runtime.microbatch import Microbatcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from rank_results import gather_and_write


def model_and_batch(samples: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4)).double()
    data = (torch.randn(2 * samples, 32, dtype=torch.float64), torch.randn(2 * samples, 4, dtype=torch.float64))
    return model, data


def peak(micro: int, samples: int) -> int:
    model, data = model_and_batch(samples)
    device = bf.SimulatedDevice("1GiB")
    batcher = Microbatcher(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss, device=device, micro_batch_size=micro
    )
    for _ in range(2):
        batcher.step((data[0][:samples], data[1][:samples]))
    return device.peak_bytes()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    samples = 64  # per rank
    small = (peak(16, samples) + peak(32, samples)) // 2  # fits micro-batches of 16, not 32
    capacity = small if rank == 1 else 2**30

    model, (inputs, targets) = model_and_batch(samples)
    mine = slice(rank * samples, (rank + 1) * samples)
    probe_model = copy.deepcopy(model)
    found = bf.find_max_batch_size(
        probe_model,
        (inputs[mine], targets[mine]),
        loss_fn=F.mse_loss,
        optimizer=torch.optim.SGD(probe_model.parameters(), lr=0.1),
        device=bf.SimulatedDevice(capacity),
        max_batch_size=samples,
    )

    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    batcher = Microbatcher(
        ddp,
        torch.optim.SGD(ddp.parameters(), lr=0.1),
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice(capacity),
        micro_batch_size=samples,
    )
    batcher.step((inputs[mine], targets[mine]))
    F.mse_loss(reference(inputs), targets).backward()  # the full batch of both ranks, on one process
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    difference = max(
        float((a - b).abs().max()) for a, b in zip(ddp.module.parameters(), reference.parameters(), strict=True)
    )
    record = batcher.history[-1]
    result = {
        "rank": rank,
        "found": found.batch_size,
        "micro": record.micro_batch_size,
        "ooms": record.ooms,
        "difference": difference,
    }
    gather_and_write(result, sys.argv[1])


if __name__ == "__main__":
    main()
