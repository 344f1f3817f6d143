"""The body of ``batchfit.cli.tokens``: it imports the library (and torch), so the face imports it only when
the command runs."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import Amp
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import header_line
from batchfit.cli.common import parse_margin
from batchfit.cli.common import write_json
from batchfit.cli.loading import with_loop
from batchfit.cli.progress import ConsoleProgress
from batchfit.cli.sharded import ParallelOptions
from batchfit.cli.workloads import load_workload
from batchfit.devices.presets import refuse_preset
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.parallel.settings import Parallelism
from batchfit.search.runner import device_for
from batchfit.search.settings import SearchSettings
from batchfit.search.soak import SoakSettings
from batchfit.search.soak import check_soak_device
from batchfit.search.soak_result import soak_summary
from batchfit.tokens.budget import token_budget_of_workload
from batchfit.tokens.length_data import LengthSample
from batchfit.tokens.lengths import bucket_lengths
from batchfit.tokens.lengths import parse_buckets
from batchfit.tokens.result import MODES
from batchfit.tokens.result import ModeBudget
from batchfit.tokens.soak import soak_token_budget
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import route_workload
from batchfit.workflows.sharded_tokens import sharded_token_budget


def run_tokens(
    *,
    workload: str,
    buckets: str | None,
    max_seq_len: int | None,
    num_buckets: int,
    device: str,
    margin: str,
    packed: bool | None,
    forward: bool,
    accumulating: bool,
    amp: Amp | None,
    keep_output: bool,
    model_settings: list[str] | None,
    gpu: str | None,
    verify: bool,
    json_path: Path | None,
    parallel: ParallelOptions,
    activation_checkpointing: str,
    debug: bool,
    lengths: Path | None = None,
    soak: int | None = None,
    eval_every: int | None = None,
    seed: int = 0,
) -> None:
    """The body of ``batchfit tokens`` (see its help): the largest batch per sequence-length bucket and the tokens per micro-batch that fit, padded and packed."""
    refuse_preset(device)
    soaking = soak_options(lengths, soak, eval_every, seed)
    lengths_file, lengths = (
        lengths,
        bucket_lengths(parse_buckets(buckets) if buckets is not None else None, max_seq_len, num_buckets),
    )
    check_outputs(json_path)
    if route_workload(workload, parallel.asked) is Route.CONFIG:
        if model_settings:
            raise InputError("--set passes settings to a workload's own function: a model from its config has none")
        if forward or packed or device != "auto" or amp is not None:
            raise InputError(
                "a model from its config is traced per rank on padded token ids: drop --forward, --packed, --device "
                "and --amp (--param-dtype sets its precision), or give a workload of your own"
            )
        per_rank(workload, lengths, gpu, parallel.choices(activation_checkpointing), verify, accumulating, json_path)
        return
    if soaking is not None and route_workload(workload, parallel.asked) is not Route.OWN:
        raise InputError("--soak replays one device's allocator: soak a workload of your own on sim:CAPACITY:cuda")
    if parallel.asked or gpu or verify:
        raise InputError(
            "--gpus, --gpu and --verify measure a model from its config per rank (an LLM preset or a config.json); "
            "for a workload of your own, run it on the device with --device"
        )
    if activation_checkpointing != "none":
        raise InputError(
            "--activation-checkpointing applies to a model built from its config (an LLM preset or a config.json); "
            "a workload of your own checkpoints as its function builds it"
        )
    options = {"seq_len": lengths[-1], "amp_dtype": amp.value if amp else None}
    work = with_loop(load_workload(workload, only_accepted=True, settings=model_settings or (), **options), keep_output)
    dev = device_for(work, device)
    if soaking is not None:
        check_soak_device(dev)
        sample = LengthSample.of(lengths_file)  # read before any trial
    console.print(header_line(work, dev, "tokens"))
    console.print(f"Buckets (longest sequence of each): {', '.join(map(str, lengths))}")
    if accumulating:
        console.print("Training measured as a later micro-batch of an accumulation window (its gradients held).")
    settings = SearchSettings(margin=parse_margin(margin))
    with console.status("Searching the buckets ..."):
        budget = token_budget_of_workload(
            work, lengths, settings, device=dev, packed=packed, forward=forward, accumulating=accumulating
        )
    for mode in budget.modes:
        print_mode(mode)
    print_lines(budget.lines)
    console.print(f"{budget.trials} trials in all, {budget.seconds:.1f} s.")
    document = budget.to_dict()
    if soaking is not None:
        with console.status(f"Soaking {soaking.steps} steps of the data's lengths ..."):
            run = soak_token_budget(work, budget, sample, soaking, device=dev, margin=parse_margin(margin))
        document["soak"] = run.to_dict()
        console.print(escape(soak_summary(document["soak"], soaking.steps)), soft_wrap=True)
        console.print(escape(f"Binds: {run.binding()}."), soft_wrap=True)
    if json_path is not None:
        write_json(json_path, document)
        console.print(f"Wrote {json_path}")


def soak_options(lengths: Path | None, soak: int | None, eval_every: int | None, seed: int) -> SoakSettings | None:
    """``--lengths``, ``--soak``, ``--eval-every`` and ``--seed`` checked together (``None``: no soak asked)."""
    if soak is None:
        if lengths is not None or eval_every is not None:
            raise InputError("--lengths and --eval-every are for a soak: give --soak too, e.g. --soak 1000")
        return None
    if lengths is None:
        raise InputError("--soak draws its steps from the data's lengths: give --lengths FILE (one length a line)")
    return SoakSettings(soak, eval_every, seed=seed)


def per_rank(
    workload: str,
    lengths: list[int],
    gpu: str | None,
    choices: list[Parallelism],
    verify: bool,
    accumulating: bool,
    json_path: Path | None,
) -> None:
    """A model from its config: each bucket traced per rank (as a later micro-batch of an accumulation window where
    ``accumulating``), and with ``verify`` proved by one rank's real trials."""
    if gpu is None:
        raise InputError("a model from its config is traced per rank: give --gpu h100-80gb (a preset) or --gpu 80GiB")
    if len(choices) != 1:
        raise InputError("token budgets trace one activation-checkpointing choice at a time: none, selective or full")
    parallelism = choices[0]
    console.print(f"batchfit tokens: [bold]{escape(workload)}[/], one rank of {parallelism.world_size} under FSDP2")
    if accumulating:
        console.print("Training measured as a later micro-batch of an accumulation window (its gradient shards held).")
    budget = sharded_token_budget(
        workload, lengths, gpu, parallelism, verify=verify, accumulating=accumulating, progress=ConsoleProgress()
    )
    table = Table(title=f"Per rank on {escape(gpu)}: padded batches")
    columns = ("longest seq", "batch", "tokens", "traced", *(("whole step",) if accumulating else ()), "traces")
    for column in (*columns, "real trials"):
        table.add_column(column, justify="right")
    for bucket in budget.buckets:
        trials = "-" if bucket.verified is None else str(len(bucket.verified.trials))
        whole = () if bucket.whole_step is None else (bucket.whole_step.batch_size,)
        cells = (bucket.seq_len, bucket.batch_size, bucket.tokens, bucket.traced.batch_size, *whole, bucket.traces)
        table.add_row(*map(str, cells), trials)
    console.print(table)
    print_lines(budget.lines)
    console.print(f"{budget.traces} traces and {budget.trials} real trials in all.")
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
    if mode.too_long:
        longest = mode.buckets[-1].seq_len
        console.print(
            f"Not even one sequence of {', '.join(map(str, mode.too_long))} tokens fits: cap sequences at {longest} "
            "tokens here, or measure buckets between."
        )
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


def print_lines(stacks: dict[str, list[str]]) -> None:
    """The ready lines, stack by stack."""
    for stack, lines in stacks.items():
        console.print(f"[bold]{escape(stack)}[/]")
        for line in lines:
            console.print("  " + escape(line), soft_wrap=True)
