"""Started twice by test_distributed.py (env:// rendezvous, no torchrun). On the raising rank the
loss raises a ValueError from batch size 8 on; that rank catches it from ``find_max_batch_size``
and stays alive (as a training script that carries on would) until the other rank is done. The
other rank must fail with a clear error naming the raising rank within the agreement timeout, not
hang. Both ways, one after the other: rank 0 raises in the env:// group, then rank 1 in a new
group on PORT (the first group cannot be used after a failed agreement).

Usage: ``ddp_raising_rank.py OUT PORT``; when rank R raises, rank Q writes ``OUT.R.Q`` (JSON: its
error, how long its search ran and when it ended).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

import batchfit as bf

STAY_ALIVE_SECONDS = 30  # at most: the raising rank goes on as soon as the other rank is done


def _search(raiser: int, rank: int) -> dict:
    """How this rank's search ended, when the loss raises on ``raiser``."""

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if rank == raiser and output.shape[0] >= 8:
            raise ValueError(f"a bad batch of {output.shape[0]} on rank {rank}")
        return F.cross_entropy(output, target)

    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        bf.find_max_batch_size(
            torch.nn.Linear(8, 2),
            (torch.randn(4, 8), torch.randint(0, 2, (4,))),
            loss_fn=loss_fn,
            device=bf.SimulatedDevice("1MiB"),
            max_batch_size=64,
            trace=False,
        )
        error = None
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
    return {"error": error, "seconds": time.perf_counter() - start, "ended": time.time()}


def _one_way(out: str, raiser: int, **init: object) -> None:
    dist.init_process_group("gloo", **init)
    rank = dist.get_rank()
    outcome = _search(raiser, rank)
    partial = Path(f"{out}.{raiser}.{rank}.partial")
    partial.write_text(json.dumps(outcome))
    partial.rename(f"{out}.{raiser}.{rank}")  # whole: the raising rank polls for it
    if rank == raiser:
        other = Path(f"{out}.{raiser}.{1 - rank}")
        deadline = time.monotonic() + STAY_ALIVE_SECONDS
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    # The raising rank's teardown closes its connections, which ends the collective the other
    # rank may have left waiting: then the other rank's teardown returns too.
    dist.destroy_process_group()


def main() -> None:
    out, port = sys.argv[1], int(sys.argv[2])
    _one_way(out, 0)
    _one_way(out, 1, init_method=f"tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]), world_size=2)


if __name__ == "__main__":
    main()
