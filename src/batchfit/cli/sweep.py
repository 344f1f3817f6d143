"""``batchfit sweep`` (the per-configuration search) and ``batchfit cache list|clear``.

The face: options and help, light to import; the body runs in ``batchfit.cli.sweep_run``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchfit.cli.common import AmpOption
from batchfit.cli.common import CacheDir
from batchfit.cli.common import Debug
from batchfit.cli.common import ImageSize
from batchfit.cli.common import Mode
from batchfit.cli.common import SeqLen
from batchfit.cli.common import app
from batchfit.cli.common import cli_errors
from batchfit.search.strategies import STRATEGIES
from batchfit.sweep.sources import ESTIMATE_SOURCES

cache_app = typer.Typer(
    help="The result cache: list or clear stored search results.",
    epilog="Example: batchfit cache list --cache-dir ~/.cache/batchfit",
    no_args_is_help=True,
)


app.add_typer(cache_app, name="cache")


@app.command(
    "sweep",
    epilog="Example: batchfit sweep gpt-tiny --grid seq_len=32,64,128 --grid layers=2,4 --device sim:256MiB --json sweep.json\n\n"
    "On this node's GPUs, one fresh process per configuration: batchfit sweep model.py:build --grid seq_len=512,1024 "
    "--engine local --slots cuda:0,cuda:1 --json sweep.json (re-run it to resume)\n\n"
    'Rules file (--rules, JSON or TOML): {"base_batch_size": 64, "knobs": {"max_crops": [{"upto": 2, "scale": 1.0}, '
    '{"upto": 12, "scale": 0.3}, {"scale": 0.25}], "num_active_blocks": {"ratio_of": 24}}}',
)
@cli_errors
def sweep(
    workload: Annotated[str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")],
    grid: Annotated[list[str], typer.Option(help="A knob and its values, NAME=V1,V2,... (repeat per knob).")],
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY.")] = "auto",
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "--max-batch-size", help="Upper limit, never exceeded.")
    ] = None,
    auto_adjust: Annotated[bool, typer.Option(help="Search each configuration; off: use --batch-size as is.")] = True,
    min_batch_size: Annotated[int, typer.Option(help="Smallest size to consider.")] = 1,
    strategy: Annotated[
        str, typer.Option(help=f"One of: {', '.join(STRATEGIES)} (grow: estimate, x1.5 up, then bisect).")
    ] = "auto",
    estimate: Annotated[str, typer.Option(help="Where the starting estimate comes from, in order.")] = ",".join(
        ESTIMATE_SOURCES
    ),
    rules: Annotated[Path | None, typer.Option(help="Scale-factor rules, a .json or .toml file.")] = None,
    mode: Annotated[Mode | None, typer.Option(help="train, eval or generate, for workloads that take it.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to generate, with --mode generate.")] = None,
    seq_len: SeqLen = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    margin: Annotated[str, typer.Option(help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05.")] = "0",
    max_trials: Annotated[int | None, typer.Option(help="At most this many trials per configuration.")] = None,
    measure: Annotated[
        str | None, typer.Option(help="module:function(knobs, batch_size, workload) run with each batch found.")
    ] = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", "--results", help="Results file: written after every configuration, resumed."),
    ] = None,
    cache: Annotated[bool, typer.Option(help="Answer configurations searched before from the result cache.")] = True,
    cache_dir: CacheDir = None,
    engine: Annotated[
        str,
        typer.Option(
            help="Where configurations run: inline (one after another here), local (a fresh process each on this "
            "node's slots), slurm or ray; auto: local when several GPUs are visible."
        ),
    ] = "auto",
    slots: Annotated[
        str | None, typer.Option(help="local: the devices, one configuration at a time on each (cuda:0,cuda:1).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="local: this many slots on a simulated device or the CPU.")
    ] = None,
    ray_address: Annotated[
        str | None, typer.Option(help="ray: the cluster (auto, ray://host:10001); default a local one.")
    ] = None,
    partition: Annotated[str | None, typer.Option(help="slurm: the partition.")] = None,
    time_min: Annotated[int | None, typer.Option(help="slurm: each job's time limit in minutes (default 60).")] = None,
    gpus_per_task: Annotated[
        float | None, typer.Option(help="slurm, ray: GPUs per configuration (default 1 on CUDA, else 0).")
    ] = None,
    cpus_per_task: Annotated[int | None, typer.Option(help="slurm, ray: CPUs per configuration (default 1).")] = None,
    slurm_folder: Annotated[
        Path | None, typer.Option(help="slurm: submitit's folder for jobs and logs (default batchfit-slurm).")
    ] = None,
    max_parallel: Annotated[int | None, typer.Option(help="slurm, ray: at most this many at once.")] = None,
    debug: Debug = False,
) -> None:
    """The largest batch of every configuration in a grid, each searched from an estimate."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.sweep_run import run_sweep  # torch and the workload load only when it runs

    run_sweep(**options)


@cache_app.command("list", epilog="Example: batchfit cache list --cache-dir /tmp/batchfit-cache")
@cli_errors
def cache_list(cache_dir: CacheDir = None, debug: Debug = False) -> None:
    """Show every stored result: what it was for, where, the batch size and when."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.sweep_run import run_cache_list  # torch and the workload load only when it runs

    run_cache_list(**options)


@cache_app.command("clear", epilog="Example: batchfit cache clear")
@cli_errors
def cache_clear(cache_dir: CacheDir = None, debug: Debug = False) -> None:
    """Delete every stored result."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.sweep_run import run_cache_clear  # torch and the workload load only when it runs

    run_cache_clear(**options)
