"""Run for test_distributed.py under torchrun (2 ranks, gloo; by ddp_suite.py with the other checks,
or alone). A trial that raises on one rank (not out of memory) is said in that trial's agreement:
the other rank stops at once with an error naming it, and no collective is left half-joined. The
same for a Microbatcher training step that raises on one rank."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

import batchfit as bf
from batchfit.runtime.microbatch import Microbatcher
from batchfit.search import distributed
from batchfit.search.trial import Trial

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the helpers: tests/support/
from rank_results import gather_and_write


def _probe_raising_on(raisers: set[int], rank: int):
    def probe(batch_size: int) -> Trial:
        if rank in raisers:
            raise ValueError(f"a bad batch of {batch_size} on rank {rank}")
        return Trial(batch_size, True, 100 + rank, 0.1, steps=2)

    return probe


def _outcome(raisers: set[int], rank: int) -> str:
    """How ``probe_together`` ended on this rank when the trial raised on ``raisers``."""
    try:
        trial = distributed.probe_together(_probe_raising_on(raisers, rank), 8)
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return f"fits, peak {trial.peak_bytes}"


def _search_outcome(raiser: int, rank: int) -> str:
    """How a real ``find_max_batch_size`` ended on this rank when the loss raises on ``raiser`` from
    batch size 8 on (the raising rank catches its error and carries on, as a script might)."""

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if rank == raiser and output.shape[0] >= 8:
            raise ValueError(f"a bad batch of {output.shape[0]} on rank {rank}")
        return F.cross_entropy(output, target)

    torch.manual_seed(0)
    sample = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    try:
        found = bf.find_max_batch_size(
            torch.nn.Linear(8, 2), sample, loss_fn=loss_fn, device=bf.SimulatedDevice("1MiB"), max_batch_size=64
        )
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return f"found {found.batch_size}"


def _step_outcome(raisers: set[int], rank: int) -> str:
    """How two Microbatcher steps ended on this rank when the second one's loss raised on ``raisers``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    calls = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if rank in raisers and len(calls) > 2:  # the second step's first micro-batch
            raise ValueError(f"bad targets on rank {rank}")
        return F.mse_loss(output, target)

    batcher = Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn, micro_batch_size=4)
    batch = (torch.randn(8, 8), torch.randn(8, 2))
    try:
        for _ in range(2):
            batcher.step(batch)
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "trained"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {name: _outcome(raisers, rank) for name, raisers in (("zero", {0}), ("one", {1}), ("both", {0, 1}))}
    result["none"] = _outcome(set(), rank)  # the group is still in step after the failed trials
    result["find_zero"] = _search_outcome(0, rank)
    result["find_one"] = _search_outcome(1, rank)
    result["step_zero"] = _step_outcome({0}, rank)
    result["step_none"] = _step_outcome(set(), rank)  # still in step after the failed training step
    gather_and_write(result, sys.argv[1])


if __name__ == "__main__":
    main()
