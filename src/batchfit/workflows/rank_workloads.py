"""What one rank trains, for its real trials (or traces) over torch's fake process group.

A model built from its config becomes a ``RankWorkload``; a workload of the user's own becomes the
``ShardedCopy`` its parallelism makes (``Parallelism.one_rank``): the model copied onto ``meta`` and sharded
with FSDP2, one rank's shards allocated on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchfit.errors import InputError
from batchfit.parallel.copied import ShardedCopy
from batchfit.parallel.one_rank import RankWorkload
from batchfit.parallel.settings import Parallelism
from batchfit.workflows.routing import DEFAULT_SEQ_LEN
from batchfit.workflows.routing import from_config

Loaded = tuple[Any, dict[str, Any]]  # a workload and the options that reached it (for the JSON)


def rank_workload(
    workload: str, seq_len: int | None, choices: list[Parallelism], rank: int, load: Callable[[], Loaded]
) -> Loaded:
    """What rank ``rank`` of the one parallelism in ``choices`` trains: a ``RankWorkload`` of a model from its
    config (``workload`` an LLM preset or a config.json), else the ``ShardedCopy`` of ``load()``'s workload;
    with the options for the JSON (the parallelism's among them)."""
    if len(choices) != 1:
        raise InputError(
            "one-rank trials run one activation-checkpointing choice at a time: give none, selective or full"
        )
    refuse_inside_a_group()
    parallelism = dataclasses.replace(choices[0], rank=rank)
    if from_config(workload):
        seq_len = seq_len or DEFAULT_SEQ_LEN
        return RankWorkload(workload, seq_len, parallelism), {"seq_len": seq_len, "parallelism": parallelism.to_dict()}
    work, options = load()
    return ShardedCopy(work, parallelism), {**options, "parallelism": parallelism.to_dict()}


def accumulating(work: Any) -> Any:
    """``work`` run as a later micro-batch of an accumulation window (the window's gradients held): a
    ``Workload``, or one rank's ``ShardedCopy`` of one."""
    own = getattr(work, "workload", None)
    if own is not None:
        return dataclasses.replace(work, workload=dataclasses.replace(own, accumulating=True))
    return dataclasses.replace(work, accumulating=True)


def refuse_inside_a_group() -> None:
    """One line when a process group is already up (under ``torchrun``): one-rank trials start their own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise InputError(
            "one-rank trials start their own fake process group, and one is already initialised (torchrun): "
            "run batchfit find --gpus outside torchrun, or search your sharded model on every rank under torchrun"
        )
