"""Run for test_accumulate.py under torchrun (2 ranks, gloo; by ddp_suite.py with the other checks,
or alone): does accumulation under DDP give the full batch's gradient? Rank 0 writes the largest
difference to the path in argv[1]."""

import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from batchfit.runtime.accumulate import GradientAccumulator


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    inputs, targets = torch.randn(10, 6, dtype=torch.float64), torch.randn(10, 2, dtype=torch.float64)
    torch.nn.functional.mse_loss(reference(inputs), targets).backward()
    expected = [p.grad.clone() for p in reference.parameters()]

    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    )
    model.module.load_state_dict(reference.state_dict())
    share = slice(rank * 10 // world, (rank + 1) * 10 // world)  # 5 samples a rank, micro-batches of 2, 2, 1
    accumulator = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2, loss_fn=torch.nn.functional.mse_loss
    )
    accumulator.accumulate((inputs[share], targets[share]))
    difference = max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected, strict=True))
    if rank == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(
                {"difference": difference, "micro_batches": accumulator.micro_batches_last_step, "world": world}, handle
            )
    dist.barrier()  # both ranks done before either tears down: gloo aborts on a one-sided teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
