"""The per-rank FSDP2 plan with a device to time it on (``--verify``): each checkpointing choice's planned
micro-batch is timed in one rank's real steps, and the plan takes the choice the timings rank first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import batchfit as bf
from batchfit.parallel.settings import Parallelism
from batchfit.planning.plan import plan_batch
from batchfit.throughput.frontier_result import choose
from batchfit.workflows.sharded_plan import plan_sharded
from batchfit.workflows.sharded_timing import TOLERANCE

LLAMA = str(Path(__file__).parents[2] / "examples/llama-tiny.json")


def _plan(**verify: Any) -> Any:
    """The tiny Llama's plan for a global batch of 64 on 2 ranks, with and without checkpointing."""
    choices = [Parallelism(world_size=2, activation_checkpointing=choice) for choice in ("none", "full")]
    return plan_sharded(
        LLAMA,
        "8MiB",
        64,
        choices,
        lambda largest: plan_batch(micro_batch_size=largest, global_batch_size=64, devices=2),
        **verify,
    )


@pytest.mark.slow
def test_with_a_device_the_sharded_plan_chooses_by_one_ranks_timed_steps() -> None:
    found = _plan(verify_on=bf.SimulatedDevice("8MiB"))
    assert found.timed is not None and [c.policy for c in found.timed] == ["none", "full"]
    assert all(c.samples_per_second and c.step_seconds for c in found.timed)
    assert found.chosen.activation_checkpointing == choose(found.timed, TOLERANCE)[0].policy
    timed = found.to_dict()["sharding"]["timed"]
    assert [row["policy"] for row in timed] == ["none", "full"]
    for choice, (_parallelism, largest) in zip(found.timed, found.found, strict=True):
        assert choice.micro_batch_size <= largest.batch_size


@pytest.mark.slow
def test_without_a_device_the_sharded_plan_chooses_by_memory_as_before() -> None:
    found = _plan()
    assert found.timed is None and "timed" not in found.to_dict()["sharding"]
    assert found.chosen.activation_checkpointing == "none"
