"""Run by test_parallel_agreement.py under torchrun (N ranks, gloo, CPU): real FSDP2 trains each case
of ``CASES`` (tiny models, 3 steps) and every rank writes its per-step peak bytes, counted by
batchfit's rank counter, to ``OUT_DIR/CASE.RANK.json``. The test traces the same cases on fake
tensors over a fake world of N ranks and compares.

Usage: ``torchrun --nproc_per_node=N fsdp_agreement.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/

from batchfit.parallel.trace import count_steps
from batchfit.parallel.trace import default_optimizer
from batchfit.parallel.wrap import shard_model
from fsdp_cases import CASES


def run_case(name: str, out: Path, world_size: int, rank: int) -> None:
    case = CASES[name]
    parallelism = case.parallelism(world_size, rank)
    mesh = init_device_mesh("cpu", parallelism.mesh_shape(), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = shard_model(case.builder()(), mesh, parallelism)
    input_ids = torch.randint(0, case.vocab_size, (case.batch_size, case.seq_len))
    peaks = count_steps(model, default_optimizer(model.parameters()), input_ids, steps=case.steps)
    record = {"peaks": [step.peak_bytes for step in peaks], "breakdowns": [step.breakdown for step in peaks]}
    (out / f"{name}.{rank}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for name in CASES:  # an error ends this rank, and torchrun stops the others
        run_case(name, out, world_size, rank)
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        (out / "done").write_text(str(os.getpid()))


if __name__ == "__main__":
    main()
