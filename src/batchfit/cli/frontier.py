"""The checkpointing frontier on the command line (``optimal --checkpointing``, ``plan --checkpointing``): the
options checked before any work, the measurement said policy by policy, and the table."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import console
from batchfit.errors import InputError
from batchfit.throughput import CheckpointingFrontier
from batchfit.throughput import PolicyFrontier
from batchfit.throughput import frontier_for_workload


def check_policy_spec(spec: str, **refused: Any) -> None:
    """``spec`` checked (``auto`` or known policies) before the workload loads; ``refused`` names options the
    comparison does not take, each refused in one line where given."""
    from batchfit.step.checkpointing import parse_policies

    if spec.strip().lower() != "auto":
        parse_policies(spec)
    given = [name.replace("_", "-") for name, value in refused.items() if value is not None]
    if given:
        raise InputError(
            f"--checkpointing compares policies by their throughput-optimal batch, and does not take "
            f"--{', --'.join(given)}: drop {'them' if len(given) > 1 else 'it'}"
        )


def _said(policy: PolicyFrontier) -> None:
    if policy.largest_batch_size < 1:
        console.print(f"Checkpointing {escape(policy.policy)}: not even the smallest batch fits.", highlight=False)
        return
    held = f" ({policy.accumulating_batch_size} as a later micro-batch)" if policy.accumulating_batch_size else ""
    best = policy.throughput.point(policy.throughput.best_batch_size) if policy.throughput else None
    rate = f"; best {best.samples_per_second:,.1f} samples/s at {best.batch_size}" if best else ""
    console.print(
        f"Checkpointing {escape(policy.policy)}: the largest batch is {policy.largest_batch_size}{held}{rate}.",
        highlight=False,
    )


def frontier_table(frontier: CheckpointingFrontier) -> Table:
    """One row per policy: the largest batch (plain, and as a later micro-batch), the fastest point timed, and
    its way to the target (micro-batch x accumulation steps, or its throughput-optimal batch) at its samples/s."""
    target = f"to {frontier.global_batch_size}" if frontier.global_batch_size else "choice"
    table = Table(title="Activation checkpointing", title_justify="left")
    for header in ("policy", "largest", "later", "peak", "best/s (at)", target, "samples/s"):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for row in frontier.rows():
        best, rate = row["best_samples_per_second"], row["samples_per_second"]
        table.add_row(
            ("* " if row["chosen"] else "") + row["policy"],
            str(row["largest_batch_size"]),
            str(row["accumulating_batch_size"] or "-"),
            row["largest_peak"] or "-",
            f"{best:,.1f} ({row['best_batch_size']})" if best is not None else "-",
            row["split"],
            f"{rate:,.1f}" if rate is not None else "-",
        )
    table.caption = "largest: one plain step; later: as a later micro-batch of the window, gradients held; * chosen"
    return table


def run_frontier(work: Any, device: Any, spec: str, **options: Any) -> CheckpointingFrontier:
    """Measure each policy on ``work``, saying each as it is measured, and print the table and the choice."""
    with console.status("Measuring each activation-checkpointing policy", spinner="dots"):
        frontier = frontier_for_workload(work, spec, device=device, on_policy=_said, **options)
    console.print(frontier_table(frontier))
    for note in frontier.notes:
        console.print(f"[yellow]Note:[/] {escape(note)}")
    console.print(f"[bold green]{escape(frontier.summary())}[/]")
    return frontier
