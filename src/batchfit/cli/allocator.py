"""``batchfit allocator``: replay a PyTorch memory snapshot through the caching allocator model.

The face: options and help, light to import; the body runs in ``batchfit.cli.allocator_run``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchfit.cli.common import Debug
from batchfit.cli.common import app
from batchfit.cli.common import cli_errors


@app.command(
    "allocator",
    epilog="Example: batchfit allocator snapshot.pickle --batch-size 32 "
    "(write one with torch.cuda.memory._dump_snapshot, or batchfit find --memory-snapshot snapshot.pickle)",
)
@cli_errors
def allocator(
    snapshot: Annotated[
        Path,
        typer.Argument(
            help="A memory snapshot: the pickle torch.cuda.memory._dump_snapshot(path) writes, or batchfit "
            "find/estimate --memory-snapshot."
        ),
    ],
    batch_size: Annotated[
        int | None,
        typer.Option(
            help="The batch the snapshot was recorded at: also say the largest batch the replay suggests "
            "(default: the batch batchfit noted in a snapshot it wrote)."
        ),
    ] = None,
    capacity: Annotated[
        str | None,
        typer.Option(
            help="The memory the allocator could take, e.g. 79GiB (default: batchfit's note, else the first oom's "
            "reserved bytes plus the device's free bytes; else unlimited)."
        ),
    ] = None,
    settings: Annotated[
        str | None,
        typer.Option(help="Replay with this PYTORCH_CUDA_ALLOC_CONF instead of the settings the snapshot names."),
    ] = None,
    try_settings: Annotated[
        list[str] | None,
        typer.Option(
            "--try",
            help="Settings to try on the request that ran out of memory (repeat it; default: "
            "expandable_segments:True, max_split_size_mb:128 and max_split_size_mb:512).",
        ),
    ] = None,
    device_index: Annotated[
        int | None, typer.Option(help="The device whose trace to replay (default: the one with the most events).")
    ] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the replay's findings as JSON here.")] = None,
    debug: Debug = False,
) -> None:
    """Replay a memory snapshot through the caching allocator model and compare, event by event.

    The snapshot's requests (alloc, oom) and frees (free_completed) run in order through the model with the
    settings the snapshot names; each segment the card allocated or released, and its reserved bytes after
    every event, must come out the same. Then: what fragmentation cost at the peak, whether other settings
    would have served the request that ran out of memory, and with --batch-size the largest batch the replay
    suggests."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.allocator_run import run_allocator  # torch and the model load only when it runs

    run_allocator(**options)
