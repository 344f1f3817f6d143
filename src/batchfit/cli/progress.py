"""What a workflow says, printed: ``ConsoleProgress`` shows a spinner around each long step, prints each
finding as a line, and one rank's real trials as a table beside the fake-tensor figures."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from rich.table import Table

from batchfit.cli.common import console
from batchfit.devices.units import format_bytes
from batchfit.workflows.progress import Progress
from batchfit.workflows.verdict import PlanVerification


class ConsoleProgress(Progress):
    """The command line's ``Progress``."""

    def working(self, text: str) -> AbstractContextManager[Any]:
        return console.status(text, spinner="dots")

    def said(self, line: str) -> None:
        console.print(line, highlight=False)

    def verified(self, check: PlanVerification) -> None:
        table = Table(title=f"Verified on {check.device}: one rank's real trials against the fake-tensor estimate")
        for column in ("checkpointing", "micro-batch", "fake peak", "real peak", "difference", "real trial"):
            table.add_column(column, justify="left" if column == "checkpointing" else "right")
        for row in check.rows:
            table.add_row(*row_cells(row))
        console.print(table)
        for note in check.notes:
            console.print(f"[yellow]{note}[/]", highlight=False)


def row_cells(row: dict[str, Any]) -> tuple[str, ...]:
    """One verification row as the table's cells.

    >>> row_cells({"activation_checkpointing": "none", "batch_size": 6, "fake_peak_bytes": 1000,
    ...            "real_peak_bytes": 1010, "difference_bytes": 10, "fits": True})
    ('none', '6', '1000 B', '1010 B', '+10 B (+1.00%)', 'fits')
    """

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
