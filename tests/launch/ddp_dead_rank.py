"""Started twice by test_distributed.py (env:// rendezvous, no torchrun): rank 1 dies right after
joining; rank 0 must fail with a clear error within the agreement timeout, not hang."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import batchfit as bf


def main() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os._exit(3)  # gone without a word
    model = torch.nn.Linear(8, 2)
    start = time.perf_counter()
    try:
        bf.find_max_batch_size(
            model,
            (torch.randn(4, 8), torch.randint(0, 2, (4,))),
            loss_fn=torch.nn.functional.cross_entropy,
            device=bf.SimulatedDevice("1MiB"),
        )
        outcome = {"error": None}
    except RuntimeError as error:
        outcome = {"error": str(error)}
    outcome["seconds"] = time.perf_counter() - start
    with open(sys.argv[1], "w") as handle:
        json.dump(outcome, handle)
    os._exit(0)  # the process group cannot be torn down cleanly with a peer gone


if __name__ == "__main__":
    main()
