"""What ``find``/``estimate``/``plan ... --gpus N`` print about one rank: its option and its heading.

Outside ``torchrun``, the model (built from its config for an LLM preset or a config.json, else the
workload's own, copied onto ``meta``) is sharded with torch's FSDP2 over a fake process group of N ranks, and
one rank's training steps run on the local device (``cuda``, ``cpu`` or ``sim:CAPACITY``) or are traced on a
trace device: the work is ``batchfit.workflows.rank_workload`` over ``batchfit.parallel``.
"""

from __future__ import annotations

from typing import Annotated
from typing import Any

import typer
from rich.markup import escape

from batchfit.devices.units import format_bytes

Rank = Annotated[int, typer.Option(help="With --gpus: the rank whose real trials run (0 to N-1).")]


def parameters_text(count: int) -> str:
    """A parameter count as people say it.

    >>> parameters_text(8_030_261_248), parameters_text(531_200)
    ('8.03B', '0.53M')
    """
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def header(work: Any, device: Any, command: str = "find") -> str:
    """The first lines of ``batchfit find`` (or ``estimate``) for one rank: the model, the rank, the
    device, what is measured (real trials, or traces on a ``TraceDevice``)."""
    from batchfit.devices.trace import TraceDevice  # the library loads when a command runs, not with its help
    from batchfit.workflows.ranks import describe_parallelism

    own = getattr(work, "workload", None)  # a ShardedCopy of the user's workload
    if own is not None:
        optimizer = type(own.optimizer).__name__ if own.optimizer is not None else "no optimizer"
        batches = "its own micro-batches"
    else:
        optimizer, batches = "AdamW", f"micro-batches of {work.seq_len} tokens"
    traced = isinstance(device, TraceDevice)
    line = (
        f"batchfit {command}: [bold]{escape(work.name)}[/] ({parameters_text(work.parameter_count())} parameters, "
        f"{optimizer}), {describe_parallelism(work.parallelism)}, {batches} on [bold]{device.name}[/]"
        f"\nOne rank, {'traced on fake tensors (nothing allocated)' if traced else 'real trials'}: "
        "this rank's shards only, over torch's fake process group; collectives are not run and NCCL's buffers are "
        "not counted."
    )
    if device.simulated and not traced:  # a trace device is said above: nothing runs, on a GPU or a simulation
        line += (
            f"\n[yellow]Simulated:[/] a {format_bytes(device.capacity_bytes())} device on the CPU, not a GPU "
            "measurement (choose with --device sim:CAPACITY)."
        )
    return line
