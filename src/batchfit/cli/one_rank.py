"""Real trials of one rank at world size N from the CLI: ``find``/``plan WORKLOAD --gpus N
--device ...`` and ``plan CONFIG --gpus N --verify``.

Outside ``torchrun``, the model (built from its config for an LLM preset or a config.json, else
the workload's own, copied onto ``meta``) is sharded with torch's FSDP2 over a fake process group
of N ranks, and one rank's real training steps run on the local device (``cuda``, ``cpu`` or
``sim:CAPACITY``): see ``batchfit.parallel.one_rank`` and ``batchfit.parallel.copied``.
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


def rank_workload(
    workload: str, seq_len: int | None, choices: list[Any], rank: int, loaded: Any = None
) -> tuple[Any, dict[str, Any]]:
    """What one rank of the one parallelism in ``choices`` trains, for real trials over the fake
    group: a ``RankWorkload`` of a model from its config (an LLM preset or a config.json), or the
    ``ShardedCopy`` of ``loaded()`` (the workload the CLI loads, with its options for the JSON)."""
    from batchfit.cli.sharded import DEFAULT_SEQ_LEN
    from batchfit.cli.sharded import from_config
    from batchfit.parallel.one_rank import RankWorkload

    if len(choices) != 1:
        raise InputError(
            "one-rank trials run one activation-checkpointing choice at a time: give none, selective or full"
        )
    _refuse_inside_a_group()
    parallelism = dataclasses.replace(choices[0], rank=rank)
    if from_config(workload):
        seq_len = seq_len or DEFAULT_SEQ_LEN
        return RankWorkload(workload, seq_len, parallelism), {"seq_len": seq_len, "parallelism": parallelism.to_dict()}
    work, options = loaded()
    return parallelism.one_rank(work), {**options, "parallelism": parallelism.to_dict()}


def accumulating(work: Any) -> Any:
    """``work`` run as a later micro-batch of an accumulation window (its gradients held): a
    ``Workload`` or one rank's ``ShardedCopy`` of one."""
    own = getattr(work, "workload", None)
    if own is not None:
        return dataclasses.replace(work, workload=dataclasses.replace(own, accumulating=True))
    return dataclasses.replace(work, accumulating=True)


def _refuse_inside_a_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise InputError(
            "one-rank trials start their own fake process group, and one is already initialised (torchrun): "
            "run batchfit find --gpus outside torchrun, or search your sharded model on every rank under torchrun"
        )


def parameters_text(count: int) -> str:
    """A parameter count as people say it.

    >>> parameters_text(8_030_261_248), parameters_text(531_200)
    ('8.03B', '0.53M')
    """
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def header(work: Any, device: Any, command: str = "find") -> str:
    """The first lines of ``batchfit find`` (or ``estimate``) for one rank: the model, the rank, the
    device, what is measured (real trials, or traces on a ``TraceDevice``)."""
    from batchfit.cli.sharded import describe_parallelism
    from batchfit.devices.trace import TraceDevice

    own = getattr(work, "workload", None)  # a ShardedCopy of the user's workload
    if own is not None:
        optimizer = type(own.optimizer).__name__ if own.optimizer is not None else "no optimizer"
        batches = "its own micro-batches"
    else:
        optimizer, batches = "AdamW", f"micro-batches of {work.seq_len} tokens"
    line = (
        f"batchfit {command}: [bold]{escape(work.name)}[/] ({parameters_text(work.parameter_count())} parameters, "
        f"{optimizer}), {describe_parallelism(work.parallelism)}, {batches} on [bold]{device.name}[/]"
        f"\nOne rank, {'traced on fake tensors (nothing allocated)' if isinstance(device, TraceDevice) else 'real trials'}: "
        "this rank's shards only, over torch's fake process group; collectives are not run and NCCL's buffers are "
        "not counted."
    )
    if device.simulated:
        line += (
            f"\n[yellow]Simulated:[/] a {format_bytes(device.capacity_bytes())} device on the CPU, not a GPU "
            "measurement (choose with --device sim:CAPACITY)."
        )
    return line


def verification_device(device: str, capacity_bytes: int) -> Any:
    """Where ``--verify`` runs its real trials: ``device`` as given, or with ``auto`` a simulated
    device of the plan's capacity per rank (refused in one line if this host cannot hold it)."""
    from batchfit.devices.resolve import resolve_device
    from batchfit.devices.simulated import SimulatedDevice

    if device == "auto":
        return SimulatedDevice(capacity_bytes).for_workload(None)
    return resolve_device(device, None)


def verify_plan(
    workload: str, seq_len: int, found: list[tuple[Any, Any]], device: Any
) -> tuple[list[dict[str, Any]], list[tuple[Any, Any]]]:
    """Confirm each activation-checkpointing choice's traced answer with one rank's real trials
    at that micro-batch and the one above (``verify_largest``), printed side by side with the fake
    figures. A traced answer whose real trial failed is replaced by the largest size one rank's real
    trials fit below it (``verified_batch_size``), and the line printed says so. Returns the rows,
    JSON-ready, and ``found`` with the verified sizes."""
    from rich.table import Table

    from batchfit.cli.common import console
    from batchfit.parallel.one_rank import verified_batch_size
    from batchfit.parallel.one_rank import verify_largest

    rows, verified, notes = [], [], []
    for parallelism, largest in found:
        with console.status(f"Real trials of one rank at micro-batch {max(largest.batch_size, 1)} and above"):
            checked = verify_largest(workload, seq_len, largest, device=device)
        with console.status(f"Real trials of one rank below the traced {largest.batch_size}, where it did not fit"):
            real = verified_batch_size(workload, seq_len, largest, checked, device=device)
        rows += [row.to_dict() | {"verified_batch_size": real} for row in checked]
        if real != largest.batch_size:
            notes.append(
                f"Activation checkpointing {parallelism.activation_checkpointing}: the traced micro-batch "
                f"{largest.batch_size} did not fit in one rank's real trial; the largest that does is {real}, "
                "and the plan uses it."
            )
            largest = dataclasses.replace(largest, batch_size=real)
        verified.append((parallelism, largest))
    table = Table(title=f"Verified on {device.name}: one rank's real trials against the fake-tensor estimate")
    for column in ("checkpointing", "micro-batch", "fake peak", "real peak", "difference", "real trial"):
        table.add_column(column, justify="left" if column == "checkpointing" else "right")
    for row in rows:
        table.add_row(*_row_cells(row))
    console.print(table)
    for note in notes:
        console.print(f"[yellow]{note}[/]", highlight=False)
    return rows, verified


def verify_accumulating(
    workload: str, seq_len: int, parallelism: Any, planned: int, largest: int, device: Any
) -> list[dict[str, Any]]:
    """The plan's micro-batch, the largest with the window's gradients held and the size above,
    each as one rank's real trial of a later micro-batch of the window (no fake figure beside
    them: the trace takes the held gradients' bytes off the capacity); printed; the rows."""
    from batchfit.cli.common import console
    from batchfit.parallel.one_rank import probe_rank_batch_size

    rows = []
    for batch_size in dict.fromkeys((planned, largest, largest + 1)):
        with console.status(f"Real trial of one rank at micro-batch {batch_size}, the window's gradients held"):
            trial = probe_rank_batch_size(
                workload, seq_len, batch_size, parallelism=parallelism, device=device, accumulating=True
            )
        rows.append(
            {
                "activation_checkpointing": parallelism.activation_checkpointing,
                "batch_size": batch_size,
                "accumulating": True,
                "real_peak_bytes": trial.peak_bytes,
                "fits": trial.fits,
                "error": trial.error,
            }
        )
        verdict = f"fits (peak {format_bytes(trial.peak_bytes)})" if trial.fits else "does not fit"
        console.print(
            f"Verified on {device.name} as a later micro-batch (the window's gradients held): {batch_size} {verdict}.",
            highlight=False,
        )
    return rows


def _row_cells(row: dict[str, Any]) -> tuple[str, ...]:
    def size(nbytes: int | None) -> str:
        return format_bytes(nbytes) if nbytes is not None else "-"

    difference = row["difference_bytes"]
    share = f"{difference:+,d} B ({difference / row['fake_peak_bytes']:+.2%})" if difference is not None else "-"
    verdict = "fits" if row["fits"] else ("out of memory" if row["real_peak_bytes"] is None else "over capacity")
    return (
        row["activation_checkpointing"],
        str(row["batch_size"]),
        size(row["fake_peak_bytes"]),
        size(row["real_peak_bytes"]),
        share,
        verdict,
    )
