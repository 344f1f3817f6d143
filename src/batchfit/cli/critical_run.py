"""The body of ``batchfit.cli.critical``: it imports the library (and torch), so the face imports it only when
the command runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape
from rich.table import Table

from batchfit._version import versions
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import write_json
from batchfit.cli.workloads import load_workload
from batchfit.errors import InputError
from batchfit.planning.noise import NoiseScale
from batchfit.planning.plan import plan_batch
from batchfit.runtime.critical import critical_batch_by_training
from batchfit.runtime.noise_measure import measure_noise_scale
from batchfit.step.batching import batch_length
from batchfit.step.batching import select_rows
from batchfit.step.batching import slice_batch


def draws(population: Any, batch_size: int, seed: int) -> Iterator[Any]:
    """Batches of ``batch_size`` rows drawn with replacement from ``population`` (fixed seed)."""
    generator = torch.Generator().manual_seed(seed)
    length = batch_length(population)
    while True:
        yield select_rows(population, torch.randint(0, length, (batch_size,), generator=generator))


def tradeoff_table(noise: NoiseScale, chosen: int) -> Table:
    table = Table(title="Steps and samples relative to their minimum (McCandlish et al. 2018)", title_justify="left")
    for column in ("global batch", "steps / fewest", "samples / fewest"):
        table.add_column(column, justify="right")
    sizes = sorted({max(1, round(noise.b_simple * 2.0**k)) for k in range(-3, 4)} | {chosen})
    for row in noise.tradeoff(sizes):
        mark = "[bold]" if row["batch_size"] == chosen else ""
        table.add_row(f"{mark}{row['batch_size']:,}", f"{row['steps_ratio']:.2f}x", f"{row['samples_ratio']:.2f}x")
    return table


def run_critical(
    *,
    workload: str,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    population: int,
    devices: int,
    per_device_batch_size: int | None,
    seed: int,
    empirical: bool,
    batch_sizes: str,
    samples: int,
    seq_len: int | None,
    json_path: Path | None,
    debug: bool,
) -> None:
    """The body of ``batchfit critical`` (see its help): measure the gradient noise scale B_simple (McCandlish et al. 2018) and plan the critical batch."""

    if micro_batch_size < 1:
        raise InputError(f"--micro-batch-size must be a positive integer, got {micro_batch_size}")
    if batch_size <= micro_batch_size:
        raise InputError(f"--batch-size ({batch_size}) must be larger than --micro-batch-size ({micro_batch_size})")
    sizes = parse_sizes(batch_sizes) if empirical else []  # checked before any work, not after the measurement
    check_outputs(json_path)
    work = load_workload(workload, sample_size=population, seq_len=seq_len, only_accepted=True)
    console.print(
        f"batchfit critical: [bold]{escape(work.name)}[/], {steps} steps of {batch_size} rows "
        f"({batch_size // micro_batch_size} micro-batches of {micro_batch_size}) from {batch_length(work.sample_batch)} rows."
    )
    with console.status("Measuring gradient statistics", spinner="dots"):
        noise = measure_noise_scale(
            work.model,
            draws(work.sample_batch, batch_size, seed),
            loss_fn=work.loss_fn,
            step_fn=work.step_fn,
            steps=steps,
            micro_batch_size=micro_batch_size,
        )
    plan = plan_batch(
        micro_batch_size=per_device_batch_size or micro_batch_size,
        devices=devices,
        global_batch_size="critical",
        noise_scale=noise,
    )
    console.print(f"|G|² = {noise.grad_norm_sq:.4g}, tr(Σ) = {noise.trace_sigma:.4g}", highlight=False)
    console.print(tradeoff_table(noise, plan.global_batch_size))
    console.print(f"[bold green]{escape(noise.summary())}[/]")
    console.print(
        f"[bold green]Recommended global batch: {plan.global_batch_size:,} = {plan.micro_batch_size} per device x "
        f"{plan.gradient_accumulation_steps} accumulation steps x {plan.devices} device(s).[/]"
    )
    for warning in plan.warnings:
        console.print(f"[yellow]Warning:[/] {escape(warning)}")
    document = {
        "workload": {"name": work.name, "population": batch_length(work.sample_batch)},
        "noise_scale": noise.to_dict(),
        "plan": plan.to_dict(),
        "versions": versions(),
    }
    if empirical:
        document["empirical"] = _empirical(workload, work, population, seq_len, sizes, samples).to_dict()
    if json_path is not None:
        write_json(json_path, document)
        console.print(f"Wrote {json_path}")


def parse_sizes(text: str) -> list[int]:
    """``"8,16,32"`` as ``[8, 16, 32]``; anything else is a clear error.

    >>> parse_sizes("8, 16,32")
    [8, 16, 32]
    """
    try:
        sizes = [int(size) for size in text.split(",") if size.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise InputError(f"--batch-sizes must be positive integers separated by commas, e.g. 8,16,32, got {text!r}")
    return sizes


def _empirical(spec: str, work: Any, population: int, seq_len: int | None, sizes: list[int], samples: int) -> Any:

    if work.optimizer is None:
        raise InputError("--empirical trains: the workload needs an optimizer")

    def build(lr: float) -> tuple[Any, Any]:
        fresh = load_workload(spec, sample_size=population, seq_len=seq_len, only_accepted=True)
        for group in fresh.optimizer.param_groups:
            group["lr"] = lr
        return fresh.model, fresh.optimizer

    rows = batch_length(work.sample_batch)
    train, validation = (
        slice_batch(work.sample_batch, 0, rows * 3 // 4),
        slice_batch(work.sample_batch, rows * 3 // 4, rows),
    )
    with console.status("Training once per batch size", spinner="dots"):
        result = critical_batch_by_training(
            build,
            train,
            validation,
            samples=samples,
            batch_sizes=sizes,
            base_lr=work.optimizer.param_groups[0]["lr"],
            loss_fn=work.loss_fn,
            step_fn=work.step_fn,
        )
    table = Table(title="Validation loss after equal samples", title_justify="left")
    for column in ("batch size", "learning rate", "steps", "validation loss"):
        table.add_column(column, justify="right")
    for point in result.points:
        table.add_row(
            str(point.batch_size), f"{point.learning_rate:.3g}", str(point.steps), f"{point.validation_loss:.4f}"
        )
    console.print(table)
    console.print(f"[bold green]{escape(result.summary())}[/]")
    return result
