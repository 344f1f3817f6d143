"""Run for test_fsdp_find.py under torchrun (2 ranks, gloo, CPU; by ddp_suite.py with the other
checks, or alone): the batch-size search with real trials under real FSDP2.

Each rank builds the same small transformer, ``fully_shard``s it over a real device mesh of the two
ranks and searches with ``find_max_batch_size`` on a ``SimulatedDevice`` of its own; rank 1's is
the smaller (``CAPACITY_BYTES``). Both ranks must return the same size, which the test compares
with the fake trace of one rank (``batchfit.parallel.fit.largest_batch_size``) at that capacity.

Usage: ``torchrun --nproc_per_node=2 fsdp_find.py OUT_FILE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import batchfit as bf
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import default_optimizer
from batchfit.parallel.wrap import shard_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from fsdp_find_case import CAPACITY_BYTES
from fsdp_find_case import MAX_BATCH_SIZE
from fsdp_find_case import ROOMY_BYTES
from fsdp_find_case import SEQ_LEN
from fsdp_find_case import VOCAB_SIZE
from fsdp_find_case import build
from rank_results import gather_and_write


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The trace's loss of a plain language model (``batchfit.parallel.trace.language_model_loss``)."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), input_ids.flatten())


def _local_values(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shards of the parameters, copied."""
    return [p.to_local().clone() for p in model.parameters()]


def search(rank: int) -> dict[str, object]:
    """This rank's search, the real peak one size above its answer, and whether the search left
    the sharded model and its optimizer as they were (they then still train)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = shard_model(build(), mesh, Parallelism(world_size=dist.get_world_size()))
    optimizer = default_optimizer(model.parameters())
    sample = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN))
    capacity = CAPACITY_BYTES if rank == 1 else ROOMY_BYTES
    before = _local_values(model)
    options = {"loss_fn": next_token_loss, "optimizer": optimizer}
    found = bf.find_max_batch_size(
        model,
        sample,
        device=bf.SimulatedDevice(capacity),
        max_batch_size=MAX_BATCH_SIZE,
        trace=False,
        **options,
    )
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _local_values(model), strict=True))
    unchanged = unchanged and not optimizer.state and all(p.grad is None for p in model.parameters())
    above = bf.probe_batch_size(model, sample, found.batch_size + 1, device=bf.SimulatedDevice(ROOMY_BYTES), **options)
    next_token_loss(model(sample), sample).backward()  # FSDP2 still trains the model the search probed
    optimizer.step()
    return {
        "rank": rank,
        "capacity_bytes": capacity,
        "found": found.batch_size,
        "trials": [(t.batch_size, t.fits, t.peak_bytes) for t in found.trials],
        "above_peak_bytes": above.peak_bytes,
        "unchanged": unchanged,
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = search(rank)
    gather_and_write(result, sys.argv[1])


if __name__ == "__main__":
    main()
