"""Started by test_distributed.py under torchrun: rank 1 sleeps inside its first trial (a hang in user code);
rank 0 must name it within the agreement timeout and then end with a non-zero status, so that torchrun ends
the job instead of waiting on the sleeper."""

import time

import torch
import torch.distributed as dist

import batchfit as bf


def main() -> None:
    dist.init_process_group("gloo")
    asleep = dist.get_rank() == 1

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if asleep:
            time.sleep(600)
        return torch.nn.functional.cross_entropy(output, targets)

    model = torch.nn.Linear(8, 2)
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    bf.find_max_batch_size(model, batch, loss_fn=loss, device=bf.SimulatedDevice("1MiB"), trace=False)


if __name__ == "__main__":
    main()
