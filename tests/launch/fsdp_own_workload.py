"""Run for test_own_workload_agreement.py under torchrun (2 ranks, gloo, CPU; by ddp_suite.py with
the other checks, or alone): real FSDP2 trains a workload of one's own (``fsdp_cases.residual_mlp``:
each block ``fully_shard``ed with torch's own ``fully_shard``, then the root; AdamW; ``F.mse_loss``
against a target) in the loop a user writes, and torch's ``FSDPMemTracker`` measures each step.

At each size of ``OWN_BATCH_SIZES`` a new model trains ``STEPS`` steps. Each step starts inside
the tracker by copying the batch's rows (made once on the host, untracked, as a loader makes them)
while the last step's batch, output and loss still live; the output and loss are held through
backward and into the next step. Rank 0 writes ``{size: [every rank's step peaks]}`` to ``OUT_FILE``.

Usage: ``torchrun --nproc_per_node=2 fsdp_own_workload.py OUT_FILE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from fsdp_cases import OWN_BATCH_SIZES
from fsdp_cases import mse
from fsdp_cases import residual_mlp
from fsdp_cases import residual_mlp_optimizer
from fsdp_cases import residual_mlp_rows
from rank_results import gather_and_write

STEPS = 4  # the first step and three later ones


def step_peaks(batch_size: int, mesh: object) -> list[int]:
    """This rank's peak bytes in each step, as FSDPMemTracker counts them."""
    torch.manual_seed(0)
    model = residual_mlp()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = residual_mlp_optimizer(model.parameters())
    rows = residual_mlp_rows(batch_size)
    tracker = FSDPMemTracker(mod=model, optm=optimizer)
    batch = output = loss = None
    peaks = []
    for _ in range(STEPS):
        with tracker:  # entering starts the peak from what is held now
            batch = tuple(part.clone() for part in rows)  # batch = to_device(next(loader))
            output = model(batch[0])
            loss = mse(output, batch[1])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = tracker.get_tracker_snapshot("peak")
        peaks.append(sum(snapshot["Total"] for snapshot in peak.values()))
        tracker.reset_mod_stats()  # the tracker refuses a second iteration otherwise
    del batch, output, loss
    return peaks


def main() -> None:
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    result = {str(size): step_peaks(size, mesh) for size in OWN_BATCH_SIZES}
    gather_and_write(result, out)


if __name__ == "__main__":
    main()
