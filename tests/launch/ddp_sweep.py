"""Run by test_distributed.py under torchrun (2 ranks, gloo). Rank 1 has the smaller device: both
ranks must record the same batch sizes (what fits on rank 1), only rank 0 writes the results
file, and a second run answers every configuration from the cache on both ranks."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

import batchfit as bf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from models import decoder


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(sys.argv[1])
    device = bf.SimulatedDevice("768KiB" if rank == 1 else "1MiB")
    runs = []
    for name in ("first.json", "second.json"):
        result = bf.sweep_grid(
            decoder,
            {"seq_len": [8, 16]},
            device=device,
            results_path=out.parent / name,
            cache=out.parent / "cache",
            log=lambda line: None,
        )
        runs.append(
            {
                "sizes": [r["batch_size_used"] for r in result.records],
                "trials": result.total_trials,
                "starts": [r.get("starting_with") for r in result.records],
            }
        )
    Path(f"{out}.{rank}").write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
