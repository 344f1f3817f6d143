"""What people and scripts read: trial lines, the trials table, the answer, and JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchfit._version import versions
from batchfit.devices.units import format_bytes
from batchfit.search.result import SearchResult
from batchfit.search.trial import Trial


def trials_table(trials: Sequence[Trial], capacity_bytes: int | None, chosen: int | None = None) -> Table:
    """A rich table of every trial, in the order they ran."""
    table = Table(title="Trials", title_justify="left")
    for column, justify in [
        ("#", "right"),
        ("batch size", "right"),
        ("result", "left"),
        ("peak", "right"),
        ("of capacity", "right"),
        ("seconds", "right"),
    ]:
        table.add_column(column, justify=justify)
    for number, trial in enumerate(trials, 1):
        share = f"{trial.peak_bytes / capacity_bytes:.0%}" if trial.peak_bytes and capacity_bytes else ""
        outcome = "[green]fits[/]" if trial.fits else f"[red]{'out of memory' if trial.oom else 'over margin'}[/]"
        if trial.failed_phase:
            outcome += f" [dim]in {trial.failed_phase}[/]"
        size = f"[bold]{trial.batch_size}[/]" if trial.batch_size == chosen else str(trial.batch_size)
        table.add_row(
            str(number),
            size,
            outcome,
            format_bytes(trial.peak_bytes) if trial.peak_bytes else "",
            share,
            f"{trial.seconds:.2f}",
        )
    return table


def print_result(console: Console, result: SearchResult) -> None:
    """The trials table (none for an answer from the cache) and the one-sentence answer."""
    if result.trials:
        console.print(trials_table(result.trials, result.capacity_bytes, result.batch_size))
    console.print(f"[bold green]{escape(result.summary())}[/]")


def result_document(result: SearchResult, *, workload: str, options: dict[str, Any], simulated: bool) -> dict[str, Any]:
    """``SearchResult.to_dict()`` with what produced it: the workload, the device and the versions."""
    document = result.to_dict()
    document["workload"] = {"name": workload, "options": dict(options)}
    document["device"] = {"name": result.device, "simulated": simulated, "capacity_bytes": result.capacity_bytes}
    document["versions"] = versions()
    return document


def breakdown_table(estimate: Any) -> Table:
    """The traced breakdown at the peak beside the analytic estimate, and their difference."""
    analytic = estimate.analytic.to_dict() if estimate.analytic else {}
    table = Table(
        title=f"Memory at batch size {estimate.batch_size} (peak in {estimate.peak_phase})",
        title_justify="left",
        caption="difference: the analytic figure against the traced one",
        caption_justify="left",
    )
    for column in ("component", "traced", "analytic", "difference"):
        table.add_column(column, justify="left" if column == "component" else "right")
    rows = [*estimate.breakdown.items(), ("total (peak)", estimate.peak_bytes)]
    for name, traced in rows:
        key = "peak_bytes" if name == "total (peak)" else name
        guess = analytic.get(key)
        if guess is None:
            table.add_row(name.replace("_", " "), format_bytes(traced), "" if analytic else "-", "")
            continue
        difference = f"{(guess - traced) / traced:+.0%}" if traced else ""
        table.add_row(name.replace("_", " "), format_bytes(traced), format_bytes(guess), difference)
    return table


def throughput_table(result: Any) -> Table:
    """Every measured batch size: step time, samples/s (and tokens/s), share of the best, memory."""
    best = max(p.samples_per_second for p in result.points)
    table = Table(title="Throughput", title_justify="left")
    tokens = any(p.tokens_per_second for p in result.points)
    columns = ["batch size", "step (ms)", "samples/s", *(["tokens/s"] if tokens else []), "of best", "peak"]
    for column in columns:
        table.add_column(column, justify="right")
    for p in result.points:
        size = f"[bold]{p.batch_size}[/]" if p.batch_size == result.batch_size else str(p.batch_size)
        row = [size, f"{p.step_seconds * 1000:.1f}", f"{p.samples_per_second:,.1f}"]
        row += [f"{p.tokens_per_second:,.0f}"] if tokens else []
        row += [f"{p.samples_per_second / best:.0%}", format_bytes(p.peak_bytes)]
        table.add_row(*row)
    return table
