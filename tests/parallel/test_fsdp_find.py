"""Real trials under real FSDP2: under torchrun (2 gloo ranks, a SimulatedDevice per rank, rank 1's
the smaller), both ranks return the same size, the one the fake trace of one rank predicts."""

from __future__ import annotations

import json

import pytest

from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.models import TinyBlock
from batchfit.parallel.settings import Parallelism
from ddp_launch import ddp_output
from fsdp_find_case import CAPACITY_BYTES
from fsdp_find_case import SEQ_LEN
from fsdp_find_case import build


def _one_block_bytes() -> int:
    """One transformer block's parameters in fp32: the gradient buffer FSDP2 reduce-scatters for it."""
    return sum(p.numel() * 4 for p in TinyBlock(64, 4).parameters())


def _within_gloo_timing(real: int, fake: int) -> bool:
    """gloo's worker thread lets go of a block's reduce-scatter buffer when it is done with it,
    sometimes after FSDP2's next op, while the fake process group's collectives finish at once: a
    real peak may hold that buffer (one block's gradients) more than the trace, never less."""
    return fake <= real <= fake + _one_block_bytes() + 4096


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_ranks_agree_under_fsdp2_on_the_size_the_fake_trace_predicts(tmp_path_factory) -> None:
    first, second = json.loads((ddp_output("fsdp_find", tmp_path_factory) / "out").read_text())
    assert first["found"] == second["found"] and first["trials"] == second["trials"]  # one agreed search
    assert first["capacity_bytes"] > second["capacity_bytes"] == CAPACITY_BYTES  # rank 1's device decided
    assert first["unchanged"] and second["unchanged"]  # the search left the sharded state as it was
    found = first["found"]
    traced = largest_batch_size(build, SEQ_LEN, CAPACITY_BYTES, parallelism=Parallelism(world_size=2))
    assert found == traced.batch_size >= 2, (first["trials"], traced.to_dict())
    trials = {batch_size: (fits, peak) for batch_size, fits, peak in first["trials"]}
    assert trials[found][0] and trials[found + 1] == (False, None)  # the edge was found for real
    assert _within_gloo_timing(trials[found][1], traced.estimate.peak_bytes), (trials, traced.to_dict())
    for rank in (first, second):
        assert _within_gloo_timing(rank["above_peak_bytes"], traced.above.peak_bytes), (rank, traced.to_dict())
