"""``batchfit tokens``: the token budgets of a workload over sequence-length buckets.

The face: options and help, light to import; the body runs in ``batchfit.cli.tokens_run``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from batchfit.cli import sharded
from batchfit.cli.common import AmpOption
from batchfit.cli.common import Debug
from batchfit.cli.common import KeepOutput
from batchfit.cli.common import SetOption
from batchfit.cli.common import app
from batchfit.cli.common import cli_errors
from batchfit.tokens.lengths import DEFAULT_BUCKETS


@app.command("tokens", epilog="Example: batchfit tokens lm-tiny --max-seq-len 512 --device sim:256MiB --forward")
@cli_errors
@sharded.parallel_options
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
    accumulating: Annotated[
        bool,
        typer.Option(
            help="Measure training as a later micro-batch of an accumulation window, the window's gradients held "
            "(--no-accumulating: each micro-batch is a whole optimizer step)."
        ),
    ] = True,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="For a model from its config: a GPU preset (h100-80gb) or a size (80GiB) per rank."),
    ] = None,
    verify: Annotated[
        bool, typer.Option(help="For a model from its config: prove each traced answer by one rank's real trials.")
    ] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    lengths: Annotated[
        Path | None,
        typer.Option(help="The data's sequence lengths for --soak: one a line, a JSON list, or a JSON length: count."),
    ] = None,
    soak: Annotated[
        int | None,
        typer.Option(
            help="With --lengths: the tokens per micro-batch that hold for a run of this many steps (e.g. 1000) of "
            "lengths drawn from the data, replayed through the caching allocator model (sim:CAPACITY:cuda)."
        ),
    ] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="With --soak: an evaluation pass every this many steps (e.g. 100).")
    ] = None,
    seed: Annotated[int, typer.Option(help="With --soak: the seed the lengths are drawn with.")] = 0,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: sharded.Checkpointing = "none",
    debug: Debug = False,
) -> None:
    """The largest batch per sequence-length bucket and the tokens per micro-batch that fit, padded and packed.

    Each bucket is measured at its longest sequence, and every answer is tried for real with one more
    failing. The first two buckets are searched; a fit of their trials (fixed + per-token +
    per-squared-length bytes) starts every other bucket's search at its predicted size. Prints ready lines
    for verl, OpenRLHF, slime, SkyRL, NeMo-RL, lhotse, TRL and fairseq.

    An LLM preset or a config.json (with --gpus N and --gpu) is traced per rank under FSDP2, each bucket
    padded, and with --verify proved by one rank's real trials."""
    options = locals()  # every option as given, before the body's import adds a name
    from batchfit.cli.tokens_run import run_tokens  # torch and the workload load only when it runs

    run_tokens(**options)
