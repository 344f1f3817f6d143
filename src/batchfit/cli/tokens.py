"""``batchfit tokens``: the token budgets of a workload over sequence-length buckets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import AmpOption
from batchfit.cli.common import Debug
from batchfit.cli.common import KeepOutput
from batchfit.cli.common import app
from batchfit.cli.common import check_outputs
from batchfit.cli.common import cli_errors
from batchfit.cli.common import console
from batchfit.cli.common import header_line
from batchfit.cli.common import parse_margin
from batchfit.cli.common import with_loop
from batchfit.cli.report import write_json
from batchfit.cli.workloads import load_workload
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.search.runner import device_for
from batchfit.search.settings import SearchSettings
from batchfit.tokens.budget import token_budget_of_workload
from batchfit.tokens.lengths import DEFAULT_BUCKETS
from batchfit.tokens.lengths import bucket_lengths
from batchfit.tokens.lengths import parse_buckets
from batchfit.tokens.result import MODES
from batchfit.tokens.result import ModeBudget
from batchfit.tokens.result import TokenBudget
from batchfit.workflows.routing import from_config


@app.command("tokens", epilog="Example: batchfit tokens lm-tiny --max-seq-len 512 --device sim:256MiB --forward")
@cli_errors
def tokens(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "lm-tiny",
    buckets: Annotated[str | None, typer.Option(help="Each bucket's longest sequence, e.g. 256,512,1024,2048.")] = None,
    max_seq_len: Annotated[
        int | None, typer.Option(help="The longest sequence: buckets are it, its half, its quarter ...")
    ] = None,
    num_buckets: Annotated[int, typer.Option(help="How many buckets --max-seq-len makes.")] = DEFAULT_BUCKETS,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY (e.g. sim:8GiB).")] = "auto",
    margin: Annotated[str, typer.Option(help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05.")] = "0",
    packed: Annotated[
        bool | None,
        typer.Option(
            "--packed/--no-packed",
            help="Measure (or skip) the packed budget; by default measured where the sample can be packed.",
        ),
    ] = None,
    forward: Annotated[
        bool, typer.Option(help="Also measure forward-only budgets (scoring, reference and rollout log-probs).")
    ] = False,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    debug: Debug = False,
) -> None:
    """The largest batch per sequence-length bucket and the tokens per micro-batch that fit, padded and packed.

    Each bucket is measured at its longest sequence, and every answer is tried for real with one more
    failing. The first two buckets are searched; a fit of their trials (fixed + per-token +
    per-squared-length bytes) starts every other bucket's search at its predicted size. Prints ready lines
    for verl, OpenRLHF, slime, SkyRL, NeMo-RL, lhotse, TRL and fairseq."""
    if from_config(workload):
        raise InputError(
            f"{workload} is a model built from its config: token budgets per rank under FSDP2 are not measured yet; "
            "give a workload of your own (module:function returning a batchfit.Workload)"
        )
    lengths = bucket_lengths(parse_buckets(buckets) if buckets is not None else None, max_seq_len, num_buckets)
    check_outputs(json_path)
    options = {"seq_len": lengths[-1], "amp_dtype": amp.value if amp else None}
    work = with_loop(load_workload(workload, only_accepted=True, **options), keep_output)
    dev = device_for(work, device)
    console.print(header_line(work, dev, "tokens"))
    console.print(f"Buckets (longest sequence of each): {', '.join(map(str, lengths))}")
    settings = SearchSettings(margin=parse_margin(margin))
    with console.status("Searching the buckets ..."):
        budget = token_budget_of_workload(work, lengths, settings, device=dev, packed=packed, forward=forward)
    for mode in budget.modes:
        print_mode(mode)
    print_lines(budget)
    console.print(f"{budget.trials} trials in all, {budget.seconds:.1f} s.")
    if json_path is not None:
        write_json(json_path, budget.to_dict())
        console.print(f"Wrote {json_path}")


def print_mode(mode: ModeBudget) -> None:
    """One mode's table (a row per bucket), its packed budget and its fit."""
    table = Table(title=f"{MODES[mode.mode].capitalize()}: padded batches")
    for column in ("longest seq", "batch", "tokens", "trials", "first guess", "tokens/s"):
        table.add_column(column, justify="right")
    for bucket in mode.buckets:
        speed = bucket.tokens_per_second
        table.add_row(
            str(bucket.seq_len),
            str(bucket.batch_size),
            str(bucket.tokens),
            str(len(bucket.search.trials)),
            "-" if bucket.guess is None else str(bucket.guess),
            "-" if speed is None else f"{speed:,.0f}",
        )
    console.print(table)
    packed = mode.packed
    if packed is not None and packed.search is not None:
        speed = packed.tokens_per_second
        console.print(
            f"Packed (sequences end to end): [bold]{packed.tokens}[/] tokens per micro-batch fit, "
            f"{packed.tokens + 1} do not, with sequences of {packed.seq_len} tokens "
            f"(by length: {', '.join(f'{length}: {search.batch_size}' for length, search in packed.searches.items())}; "
            f"{packed.trials} trials" + (f", {speed:,.0f} tokens/s)." if speed else ").")
        )
    elif packed is not None:
        console.print(f"Packed: not measured: {escape(packed.skipped or '')}.")
    if mode.fit is not None:
        fit = mode.fit
        console.print(
            f"Fit: {format_bytes(fit.fixed_bytes)} fixed + {fit.bytes_per_token:,.0f} B per token + "
            f"{fit.bytes_per_squared_token:,.3f} B per squared length, per sequence "
            f"(from lengths {', '.join(map(str, fit.lengths))})."
        )


def print_lines(budget: TokenBudget) -> None:
    """The ready lines, stack by stack."""
    for stack, lines in budget.lines.items():
        console.print(f"[bold]{escape(stack)}[/]")
        for line in lines:
            console.print("  " + escape(line), soft_wrap=True)
