"""``batchfit critical``: the gradient noise scale of a workload and the global batch it implies.

The face: options and help, light to import; the body runs in ``batchfit.cli.critical_run``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchfit.cli.common import Debug
from batchfit.cli.common import SeqLen
from batchfit.cli.common import app
from batchfit.cli.common import cli_errors


@app.command(
    "critical",
    epilog="Example: batchfit critical mlp --steps 50 --batch-size 64 --micro-batch-size 8 --population 512 --json noise.json",
)
@cli_errors
def critical(
    workload: Annotated[str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")],
    steps: Annotated[int, typer.Option(help="Steps to measure (more: a smaller uncertainty).")] = 50,
    batch_size: Annotated[int, typer.Option(help="The big batch drawn each step.")] = 64,
    micro_batch_size: Annotated[int, typer.Option(help="The small batches it is split into.")] = 8,
    population: Annotated[
        int, typer.Option(help="Rows the workload's sample holds (its sample_size), drawn with replacement.")
    ] = 512,
    devices: Annotated[int, typer.Option(help="Data-parallel devices for the recommended plan.")] = 1,
    per_device_batch_size: Annotated[
        int | None, typer.Option(help="The largest micro-batch that fits (batchfit find), for the plan.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the draws.")] = 0,
    empirical: Annotated[
        bool,
        typer.Option(help="Also the empirical check: one short training run per batch size. Expensive by nature."),
    ] = False,
    batch_sizes: Annotated[str, typer.Option(help="With --empirical: the sizes to train at.")] = "8,16,32,64,128",
    samples: Annotated[int, typer.Option(help="With --empirical: samples each run trains on.")] = 4096,
    seq_len: SeqLen = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the measurement and the plan here.")] = None,
    debug: Debug = False,
) -> None:
    """Measure the gradient noise scale B_simple (McCandlish et al. 2018) and plan the critical batch.

    The batches are drawn from the workload's own sample (--population rows), with the parameters
    fixed: the noise scale of that data at the model's current point. --empirical adds the empirical
    check: a fresh model trained on --samples rows at each of --batch-sizes (the workload's learning
    rate scaled linearly from the smallest), validated on a held-out quarter of the rows. That
    costs one training run per size: expensive by nature.
    """
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.critical_run import run_critical  # torch and the workload load only when it runs

    run_critical(**options)
