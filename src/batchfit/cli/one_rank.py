"""``batchfit find MODEL --gpus N --device ...``: real trials of one rank at world size N.

Outside ``torchrun``, a model built from its config (an LLM preset or a config.json) is sharded
with torch's FSDP2 over a fake process group of N ranks, and one rank's real training steps run
on the local device (``cuda``, ``cpu`` or ``sim:CAPACITY``): see ``batchfit.parallel.one_rank``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated
from typing import Any

import typer
from rich.markup import escape

from batchfit.devices.units import format_bytes
from batchfit.errors import InputError

Rank = Annotated[int, typer.Option(help="With --gpus: the rank whose real trials run (0 to N-1).")]


def rank_workload(workload: str, seq_len: int | None, choices: list[Any], rank: int) -> tuple[Any, dict[str, Any]]:
    """The ``RankWorkload`` of ``workload`` (a preset or a config.json) as ``rank`` of the one
    parallelism in ``choices``, and the options that reached it (for the JSON)."""
    from batchfit.cli.sharded import DEFAULT_SEQ_LEN
    from batchfit.parallel.models import LLM_PRESETS
    from batchfit.parallel.one_rank import RankWorkload

    if len(choices) != 1:
        raise InputError("batchfit find tries one activation-checkpointing choice at a time: give none or full")
    if not (workload in LLM_PRESETS or workload.endswith(".json")):
        raise InputError(
            f"one-rank trials at a world size build the model from its config: give an LLM preset "
            f"(batchfit list-workloads) or a config.json, not {workload!r}"
        )
    _refuse_inside_a_group()
    parallelism = dataclasses.replace(choices[0], rank=rank)
    seq_len = seq_len or DEFAULT_SEQ_LEN
    work = RankWorkload(workload, seq_len, parallelism)
    return work, {"seq_len": seq_len, "parallelism": parallelism.to_dict()}


def _refuse_inside_a_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise InputError(
            "one-rank trials start their own fake process group, and one is already initialised (torchrun): "
            "run batchfit find --gpus outside torchrun, or search your sharded model on every rank under torchrun"
        )


def header(work: Any, device: Any) -> str:
    """The first lines of ``batchfit find`` for one rank: the model, the rank, the device, what is measured."""
    from batchfit.cli.sharded import describe_parallelism

    line = (
        f"batchfit find: [bold]{escape(work.name)}[/] ({work.parameter_count() / 1e9:.2f}B parameters, AdamW), "
        f"{describe_parallelism(work.parallelism)}, micro-batches of {work.seq_len} tokens on [bold]{device.name}[/]"
        f"\nOne rank, real trials: this rank's shards only, over torch's fake process group; "
        f"collectives are not run and NCCL's buffers are not counted."
    )
    if device.simulated:
        line += (
            f"\n[yellow]Simulated:[/] a {format_bytes(device.capacity_bytes())} device on the CPU, not a GPU "
            "measurement (choose with --device sim:CAPACITY)."
        )
    return line
