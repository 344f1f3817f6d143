"""The ``batchfit`` command: thin typer commands over the library."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from batchfit._version import versions
from batchfit.cli import one_rank
from batchfit.cli import sharded
from batchfit.cli.common import AllocatorOption
from batchfit.cli.common import AmpOption
from batchfit.cli.common import CacheDir
from batchfit.cli.common import Debug
from batchfit.cli.common import Framework
from batchfit.cli.common import FrameworkOption
from batchfit.cli.common import ImageSize
from batchfit.cli.common import KeepOutput
from batchfit.cli.common import SeqLen
from batchfit.cli.common import SetOption
from batchfit.cli.common import app
from batchfit.cli.common import check_outputs
from batchfit.cli.common import cli_errors
from batchfit.cli.common import console
from batchfit.cli.common import errors
from batchfit.cli.common import header_line
from batchfit.cli.common import load_for_cli
from batchfit.cli.common import parse_margin
from batchfit.cli.common import print_answer
from batchfit.cli.common import with_loop
from batchfit.cli.progress import ConsoleProgress
from batchfit.cli.report import breakdown_table
from batchfit.cli.report import print_result
from batchfit.cli.report import result_document
from batchfit.cli.report import throughput_table
from batchfit.cli.report import trials_table
from batchfit.cli.report import write_json
from batchfit.cli.workloads import describe_builtins
from batchfit.cli.workloads import load_workload
from batchfit.devices.base import Device
from batchfit.devices.presets import is_preset
from batchfit.devices.presets import preset
from batchfit.devices.resolve import refuse_preset
from batchfit.devices.resolve import resolve_device
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import tracing
from batchfit.devices.trace import undercount_message
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.parallel.copied import ShardedCopy
from batchfit.parallel.models import LLM_PRESETS
from batchfit.parallel.settings import Parallelism
from batchfit.planning.noise import Goodput
from batchfit.planning.noise import goodput
from batchfit.planning.plan import BatchPlan
from batchfit.planning.plan import plan_batch
from batchfit.search.estimate import MemoryEstimate
from batchfit.search.estimate import estimate_workload
from batchfit.search.evidence import before_any_trial
from batchfit.search.result import SearchResult
from batchfit.search.runner import device_for
from batchfit.search.runner import search_workload
from batchfit.search.runner import traces_first
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import STRATEGIES
from batchfit.search.trial import Trial
from batchfit.step.builtin_workloads import BUILTIN_WORKLOADS
from batchfit.throughput import ThroughputPoint
from batchfit.throughput import ThroughputResult
from batchfit.throughput import check_max_seconds
from batchfit.throughput import optimal_for_workload
from batchfit.workflows.rank_workloads import rank_workload
from batchfit.workflows.ranks import capacity_of
from batchfit.workflows.routing import DEFAULT_SEQ_LEN
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import route_workload
from batchfit.workflows.sharded_estimate import estimate_own_rank
from batchfit.workflows.sharded_plan import plan_sharded
from batchfit.workflows.verification import verification_device
from batchfit.workflows.workload_plan import plan_workload

NO_SETTINGS_FOR_CONFIG = (
    "--set passes settings to a workload's own function; a model built from its config takes --seq-len and the "
    "sharding options: drop --set, or give your own workload (file.py:function)"
)


@app.command(
    "find", epilog="Example: batchfit find gpt-tiny --seq-len 128 --device sim:8GiB --json out.json --plot out.png"
)
@cli_errors
@sharded.parallel_options
def find(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "gpt-tiny",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY (e.g. sim:8GiB).")] = "auto",
    strategy: Annotated[str, typer.Option(help=f"One of: {', '.join(STRATEGIES)}.")] = "auto",
    min_batch_size: Annotated[int, typer.Option(help="Smallest size to consider.")] = 1,
    max_batch_size: Annotated[int | None, typer.Option(help="Largest size to consider.")] = None,
    margin: Annotated[str, typer.Option(help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05.")] = "0",
    max_trials: Annotated[int | None, typer.Option(help="Stop after this many trials.")] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(help="Start no trial after this many seconds; answer the largest size confirmed so far."),
    ] = None,
    trace: Annotated[
        bool | None,
        typer.Option(
            "--trace/--no-trace",
            help="With --strategy auto: always (--trace) or never (--no-trace) estimate the edge on fake tensors "
            "first; by default auto spends the cheaper evidence, deciding from what a trial costs.",
        ),
    ] = None,
    cache: Annotated[
        bool,
        typer.Option(
            help="Answer from the result cache when this very search ran before (0 trials); --cache-dir implies it."
        ),
    ] = False,
    cache_dir: CacheDir = None,
    seq_len: SeqLen = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    framework: FrameworkOption = None,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of peak memory against batch size here.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the batch size.")] = False,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: sharded.Checkpointing = "none",
    rank: one_rank.Rank = 0,
    debug: Debug = False,
) -> None:
    """Find the largest batch size that really fits: every answer is a size a trial ran.

    With --gpus N (or --nodes and --gpus-per-node), the model (built from its config for an LLM
    preset or a config.json, else the workload's own, copied) is sharded with FSDP2 over a fake
    process group of N ranks, and one rank's real trials run on this device: the largest
    micro-batch per rank."""
    refuse_preset(device)
    loaded = functools.partial(
        load_for_cli,
        workload,
        seq_len,
        image_size,
        amp,
        framework.value if framework else None,
        keep_output,
        model_settings,
    )
    route = route_workload(workload, parallel.asked)
    if route is Route.CONFIG and model_settings:
        raise InputError(NO_SETTINGS_FOR_CONFIG)
    if route is Route.OWN:
        parallel.refuse_unused(rank)
        work, options = loaded()
        dev = device_for(work, device)
        heading = header_line(work, dev)
    else:
        work, options = rank_workload(workload, seq_len, parallel.choices(activation_checkpointing), rank, loaded)
        dev = device_for(work, device)
        heading = one_rank.header(work, dev)
    check_outputs(json_path, plot)
    if not quiet:
        console.print(heading)
    done: list[Trial] = []
    try:
        result = _search_live(
            work,
            dev,
            done,
            quiet,
            strategy=strategy,
            min_batch_size=min_batch_size,
            max_batch_size=max_batch_size,
            margin=parse_margin(margin),
            max_trials=max_trials,
            max_seconds=max_seconds,
            trace="auto" if trace is None else trace,
            cache=(cache_dir or True) if cache or cache_dir else False,  # a folder given asks for the cache
        )
    except KeyboardInterrupt:
        _interrupted(done, dev)
        raise typer.Exit(130) from None
    if quiet:
        print_answer(result.batch_size)
    else:
        print_result(console, result)
    if json_path is not None:
        write_json(json_path, result_document(result, workload=work.name, options=options, simulated=dev.simulated))
    if plot is not None and result.cached:
        errors.print("No plot: the answer came from the cache, with no trials (--no-cache measures again, then plots).")
        plot = None
    if plot is not None:
        from batchfit.cli.plots import plot_search

        plot_search(result, plot)
    if not quiet and (json_path or plot):
        console.print("Wrote " + " and ".join(str(p) for p in (json_path, plot) if p is not None))


def _search_live(work: Any, dev: Device, done: list[Trial], quiet: bool, **settings: Any) -> SearchResult:
    capacity = dev.capacity_bytes()
    # auto traces first where the device says trials are expensive; elsewhere it decides after one trial
    chosen = settings["trace"] is True or before_any_trial(dev) is not None
    traces = traces_first(work, SearchSettings(**settings), dev, capacity) and chosen
    first = "Tracing the workload on fake tensors" if traces else "Starting"
    with console.status(first, spinner="dots") as status:
        if quiet:
            status.stop()

        def started(batch_size: int) -> None:
            status.update(f"Probing batch size {batch_size}: two full training steps{bracket_text(done)}")

        def finished(trial: Trial) -> None:
            done.append(trial)
            if not quiet:
                console.print(escape(trial.describe(capacity)), highlight=False)

        return search_workload(work, device=dev, on_trial=finished, on_trial_start=started, **settings)


def bracket_text(done: list[Trial]) -> str:
    """Where the edge lies so far: ``" (fits: 10, fails: 16)"``, or ``""`` before any trial.

    >>> bracket_text([Trial(10, True, 1, 0.1), Trial(16, False, None, 0.1)])
    ' (fits: 10, fails: 16)'
    """
    if not done:
        return ""
    failed = min((t.batch_size for t in done if not t.fits), default=None)
    fitted = max((t.batch_size for t in done if t.fits and (failed is None or t.batch_size < failed)), default=None)
    return f" (fits: {fitted if fitted is not None else 'none yet'}, fails: {failed if failed is not None else 'none yet'})"


def _interrupted(done: list[Trial], dev: Device) -> None:
    if done:
        console.print(trials_table(done, dev.capacity_bytes()))
    fitted = [t.batch_size for t in done if t.fits]
    best = f"; the largest size that fitted so far was {max(fitted)} (edge not confirmed)" if fitted else ""
    errors.print(escape(f"Interrupted: the model and optimizer are restored{best}."), highlight=False)


@app.command("estimate", epilog="Example: batchfit estimate gpt-tiny --seq-len 1024 --gpu a100-40gb --batch-size 32")
@cli_errors
@sharded.parallel_options
def estimate(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "gpt-tiny",
    gpu: Annotated[
        str | None, typer.Option(help="A GPU preset, e.g. a100-40gb, h100-80gb, rtx4090-24gb, apple-64gb.")
    ] = None,
    capacity: Annotated[str | None, typer.Option(help="A memory size instead of a preset, e.g. 40GiB.")] = None,
    reserve: Annotated[
        str | None, typer.Option(help="Override the preset's per-process reserve, e.g. 500MiB or 0.")
    ] = None,
    allocator: AllocatorOption = None,
    margin: Annotated[
        str,
        typer.Option(
            help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05. auto: none, or 5% of the card where "
            "the trace ran something only the card sizes (cuDNN's convolution workspaces)."
        ),
    ] = "auto",
    accumulating: Annotated[
        bool,
        typer.Option(
            help="Estimate a later micro-batch of an accumulation window: the gradients held through forward and "
            "backward, as training with gradient accumulation runs."
        ),
    ] = False,
    batch_size: Annotated[int | None, typer.Option(help="Say whether this batch size fits, and break it down.")] = None,
    seq_len: SeqLen = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the estimate as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the memory curve here.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the largest batch size.")] = False,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: sharded.Checkpointing = "none",
    debug: Debug = False,
) -> None:
    """Estimate memory without the hardware: the largest batch that fits on a GPU, and a breakdown.

    An LLM preset (batchfit list-workloads) or a Hugging Face config.json is built from its config
    on fake tensors and traced per rank: with --gpus N (or --nodes and --gpus-per-node) under
    FSDP2, sharded by torch's own fully_shard over a fake process group."""

    if (gpu is None) == (capacity is None):
        raise InputError("give exactly one of --gpu (e.g. --gpu a100-40gb) or --capacity (e.g. --capacity 40GiB)")
    if batch_size is not None and batch_size < 1:
        raise InputError(f"--batch-size must be a positive integer, got {batch_size}")
    route = route_workload(workload, parallel.asked)
    if reserve is not None and gpu is None:
        raise InputError("--reserve overrides a GPU preset's reserve: give --gpu, or a smaller --capacity instead")
    reserve_bytes = None if reserve is None else parse_bytes(reserve, what="reserve", allow_zero=True)
    allocator_kind = allocator.value if allocator else None
    if route is Route.OWN_RANK and (":" in workload or workload in BUILTIN_WORKLOADS):
        _refuse_per_rank(margin=margin, accumulating=accumulating)
        loaded = functools.partial(
            load_for_cli, workload, seq_len, image_size, amp, keep_output=keep_output, settings=model_settings
        )
        work, options = rank_workload(workload, seq_len, parallel.choices(activation_checkpointing), 0, loaded)
        check_outputs(json_path, plot)
        tracer = TraceDevice(gpu or capacity, reserve_bytes=reserve_bytes, allocator=allocator_kind)
        _estimate_own_rank(work, options, tracer, batch_size, json_path, quiet)
        return
    if route is not Route.OWN:  # a model from its config (a name that is neither is refused there, in one line)
        if model_settings:
            raise InputError(NO_SETTINGS_FOR_CONFIG)
        _refuse_per_rank(margin=margin, accumulating=accumulating, reserve=reserve, allocator=allocator_kind)
        check_outputs(json_path, plot)
        choices = parallel.choices(activation_checkpointing)
        sharded.estimate_sharded(workload, gpu or capacity, batch_size, seq_len, choices, json_path, quiet)
        return
    parallel.refuse_unused()
    headroom = None if margin == "auto" else parse_margin(margin)
    SearchSettings(margin=headroom or 0)  # a bad margin fails here, before the model is built
    label = preset(gpu).label if gpu else None  # an unknown name fails here, naming the presets
    tracer = TraceDevice(gpu or capacity, reserve_bytes=reserve_bytes, allocator=allocator_kind)
    work, options = load_for_cli(workload, seq_len, image_size, amp, keep_output=keep_output, settings=model_settings)
    if accumulating:
        work = dataclasses.replace(work, accumulating=True)
        options["accumulating"] = True
    check_outputs(json_path, plot)
    label = label or f"a {format_bytes(tracer.capacity_bytes())} device"
    if not quiet:
        console.print(
            f"batchfit estimate: [bold]{work.name}[/] on {escape(label)} ({format_bytes(tracer.capacity_bytes())} usable), "
            "traced on fake tensors: nothing runs on a GPU.",
            highlight=False,
        )
    with console.status("Tracing", spinner="dots"), tracing():
        kept_bytes = _kept_bytes(headroom, tracer.capacity_bytes())
        searched = _leaving(tracer, kept_bytes)
        largest = search_workload(work, device=searched, trace=False)
        if headroom is None and searched.not_counted:  # the answer must leave room for what only the card sizes
            kept_bytes = int(UNCOUNTED_HEADROOM * tracer.capacity_bytes())
            searched = _leaving(tracer, kept_bytes)
            largest = search_workload(work, device=searched, trace=False)
    at = batch_size if batch_size is not None else largest.batch_size
    with warnings.catch_warnings():  # an under-count is said below, once, in the verdict's words
        warnings.simplefilter("ignore", UserWarning)
        breakdown = estimate_workload(work, at, device=searched)
    if quiet:
        print_answer(largest.batch_size)
    else:
        _print_estimate(largest, breakdown, batch_size)
        _print_headroom(searched, kept_bytes, tracer.capacity_bytes(), margin == "auto")
    if json_path is not None:
        document = {
            "workload": {"name": work.name, "options": options},
            "device": {"name": tracer.name, "gpu": gpu, "capacity_bytes": tracer.capacity_bytes()},
            "kept_free_bytes": kept_bytes,
            "largest_batch_size": largest.batch_size,
            "estimate": breakdown.to_dict(),
            "search": largest.to_dict(),
            "versions": versions(),
        }
        write_json(json_path, document)
    if plot is not None:
        from batchfit.cli.plots import plot_search

        plot_search(largest, plot)


UNCOUNTED_HEADROOM = 0.05  # the share of the card an estimate leaves for what only the card sizes (cuDNN)


def _refuse_per_rank(**given: Any) -> None:
    """Options a per-rank estimate does not read, refused in one line (an option never passes unread)."""
    defaults = {"margin": "auto", "accumulating": False, "reserve": None, "allocator": None}
    unread = [f"--{name}" for name, value in given.items() if value != defaults[name]]
    if unread:
        raise InputError(
            f"{', '.join(unread)} {'apply' if len(unread) > 1 else 'applies'} to a workload estimated on one device, "
            "not per rank: drop it, or drop --gpus/--nodes"
        )


def _kept_bytes(headroom: int | float | str | None, capacity_bytes: int) -> int:
    """The bytes a margin keeps free of ``capacity_bytes``: a fraction of it, a byte count or a size (``None``: 0)."""
    if not headroom:
        return 0
    if isinstance(headroom, float):
        return int(headroom * capacity_bytes)
    return parse_bytes(headroom) if isinstance(headroom, str) else int(headroom)


def _leaving(tracer: TraceDevice, kept_bytes: int) -> TraceDevice:
    """``tracer`` with ``kept_bytes`` fewer to give: its caching allocator and its live bytes both stop short of
    them, so what the margin keeps is free on the card (a cuDNN workspace is a request to the same allocator)."""
    if not kept_bytes:
        return tracer
    usable = tracer.capacity_bytes() - kept_bytes
    if usable <= 0:
        raise InputError(f"--margin keeps {format_bytes(kept_bytes)}, all of {tracer.name}'s memory: give less")
    return TraceDevice(
        usable, rounding_bytes=tracer.counter.rounding_bytes, allocator=tracer.allocator_settings or "exact",
        target=tracer.target,
    )  # fmt: skip


def _print_headroom(searched: TraceDevice, kept_bytes: int, capacity_bytes: int, automatic: bool) -> None:
    """What the answer leaves free, and why: a margin asked for, or the share left for what the trace cannot size."""
    if not kept_bytes:
        return
    why = (
        f"for what only the card sizes ({'; '.join(searched.not_counted)}); --margin 0 uses it all"
        if automatic
        else "the margin asked for"
    )
    console.print(
        f"The answer leaves {format_bytes(kept_bytes)} of {format_bytes(capacity_bytes)} free: {why}.", highlight=False
    )


def _estimate_own_rank(
    work: ShardedCopy, options: dict[str, Any], tracer: TraceDevice, batch_size: int | None, json_path: Path | None,
    quiet: bool,
) -> None:  # fmt: skip
    """``estimate WORKLOAD --gpus N``: one rank of a workload's sharded copy, traced on fake tensors on
    ``tracer`` (a GPU preset or a size): the largest micro-batch per rank, every trial a trace; with
    ``batch_size``, one traced trial at it says whether it fits and its peak."""
    if not quiet:
        console.print(one_rank.header(work, tracer, command="estimate"), highlight=False)
    found = estimate_own_rank(work, tracer, batch_size=batch_size, progress=ConsoleProgress())
    if quiet:
        print_answer(found.search.batch_size)
    else:
        print_result(console, found.search)
        if found.at is not None:
            console.print(escape(_verdict(found.at, tracer.capacity_bytes())), highlight=False)
    if json_path is not None:
        document = result_document(found.search, workload=work.name, options=options, simulated=False)
        if found.at is not None:  # the question asked: the figures at the micro-batch asked about
            document |= {"largest_batch_size": found.search.batch_size, "batch_size": found.at.batch_size,
                         "fits": found.at.fits, "peak_bytes": found.at.peak_bytes, "estimate": found.at.to_dict()}  # fmt: skip
        write_json(json_path, document)


def _verdict(at: Trial, capacity_bytes: int) -> str:
    """Whether the micro-batch asked about fits one rank, and its traced peak.

    >>> _verdict(Trial(8, True, 3 * 2**20, 0.1, phase_peak_bytes={"backward": 3 * 2**20}), 2**30)
    'Micro-batch 8 per rank fits: traced peak 3.0 MiB of 1.0 GiB (in backward).'
    """
    phase = max(at.phase_peak_bytes, key=at.phase_peak_bytes.get) if at.phase_peak_bytes else at.failed_phase
    where = f" (in {phase})" if phase else ""
    if at.fits:
        return f"Micro-batch {at.batch_size} per rank fits: traced peak {format_bytes(at.peak_bytes)} of {format_bytes(capacity_bytes)}{where}."
    return f"Micro-batch {at.batch_size} per rank does not fit {format_bytes(capacity_bytes)}: it runs out of memory{where}."


def _print_estimate(largest: SearchResult, breakdown: MemoryEstimate, batch_size: int | None) -> None:

    console.print(breakdown_table(breakdown))
    undercounted = breakdown.undercounted_ops
    if undercounted:
        errors.print(
            f"[yellow]Warning:[/] {escape(undercount_message(undercounted))}: the sizes below are upper "
            "bounds, not verdicts. Measure with `batchfit find --device sim:CAPACITY` instead.",
            highlight=False,
        )
    if batch_size is not None:
        verdict = {True: "fits", False: "does not fit", None: "may not fit"}[breakdown.fits]
        at_least = "at least " if undercounted else ""
        reserved = breakdown.reserved_peak_bytes
        by_allocator = f", {format_bytes(reserved)} reserved by the caching allocator" if reserved is not None else ""
        if breakdown.served is False and breakdown.peak_bytes <= breakdown.capacity_bytes:
            by_allocator = ": the caching allocator cannot serve every request (fragmentation)"
        console.print(
            f"Batch size {batch_size} {verdict}: peak {at_least}{format_bytes(breakdown.peak_bytes)} of "
            f"{format_bytes(breakdown.capacity_bytes)}{by_allocator}.",
            highlight=False,
        )
    what = "the trace allows (an upper bound)" if undercounted else "that fits"
    console.print(
        f"[bold green]Largest batch size {what}: {largest.batch_size} "
        f"(estimated from {len(largest.trials)} traced trials, {largest.seconds:.1f} s).[/]"
    )
    if breakdown.allocator != "exact":
        console.print(
            f"The fit is the caching allocator's ({breakdown.allocator}, modelled: --allocator chooses).",
            highlight=False,
        )


@app.command("optimal", epilog="Example: batchfit optimal cnn-small --device sim:512MiB --tolerance 0.05 --plot t.png")
@cli_errors
def optimal(
    workload: Annotated[
        str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")
    ] = "gpt-tiny",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY.")] = "auto",
    max_batch_size: Annotated[int | None, typer.Option(help="The largest batch to time (else found first).")] = None,
    tolerance: Annotated[
        float, typer.Option(help="Pick the smallest batch within this share of the best throughput.")
    ] = 0.05,
    safety_fraction: Annotated[
        float | None, typer.Option(help="Stay below this share of the maximum, e.g. 0.8.")
    ] = None,
    timing_warmup_steps: Annotated[
        int, typer.Option(help="Untimed warm-up steps per batch size, before the timed ones.")
    ] = 2,
    timed_steps: Annotated[
        int, typer.Option(help="Timed steps per batch size (their median counts), after the warm-up steps.")
    ] = 5,
    noise_scale: Annotated[
        float | None, typer.Option(help="B_simple (batchfit critical): also report the goodput-optimal batch (Pollux).")
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="Sequence length, for workloads that take one (adds tokens/s).")
    ] = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of throughput and memory against batch size here.")
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(help="Time no new batch size after this many seconds (the search for the largest included)."),
    ] = None,
    debug: Debug = False,
) -> None:
    """Maximum is not optimal: time steps across batch sizes and pick the throughput-optimal one."""
    refuse_preset(device)
    check_max_seconds(max_seconds)
    work, options = load_for_cli(workload, seq_len, image_size, amp, keep_output=keep_output, settings=model_settings)
    dev = resolve_device(device, work.model)
    check_outputs(json_path, plot)
    console.print(header_line(work, dev, "optimal"))
    with console.status("Finding the largest batch, then timing steps across batch sizes", spinner="dots") as status:

        def timed(point: ThroughputPoint) -> None:
            console.print(escape(_timed_line(point)), highlight=False)
            status.update(f"Timed batch size {point.batch_size}; timing the next")

        result = optimal_for_workload(
            work,
            device=dev,
            max_batch_size=max_batch_size,
            tolerance=tolerance,
            safety_fraction=safety_fraction,
            timing_warmup_steps=timing_warmup_steps,
            timed_steps=timed_steps,
            tokens_per_sample=seq_len,
            on_point=timed,
            max_seconds=max_seconds,
        )
    console.print(throughput_table(result))
    knees = ", ".join(f"{int(f * 100)}% at {k:,.0f}" for f in (0.9, 0.95) if (k := result.knee(f)) is not None)
    console.print(
        f"Fitted step time {result.alpha_seconds * 1000:.2f} ms + {result.beta_seconds_per_sample * 1000:.3f} ms x batch; "
        f"throughput knees: {knees or 'none (' + result.no_knee_reason + ')'}.",
        highlight=False,
    )
    for note in result.notes:
        console.print(f"[yellow]Note:[/] {escape(note)}")
    console.print(f"[bold green]{escape(result.summary())}[/]")
    extra = {"goodput": _print_goodput(result, noise_scale).to_dict()} if noise_scale is not None else {}
    if json_path is not None:
        write_json(
            json_path,
            {
                "workload": {"name": work.name, "options": options},
                **extra,
                "device": {"name": dev.name, "simulated": dev.simulated},
                **result.to_dict(),
                "versions": versions(),
            },
        )
    if plot is not None:
        from batchfit.cli.plots import plot_throughput

        plot_throughput(result, plot)


def _timed_line(point: ThroughputPoint) -> str:
    """One line per size as it is timed: ``Batch size 64: 1,234 samples/s (1,200-1,260), 51.9 ms a step``."""
    return (
        f"Batch size {point.batch_size}: {point.samples_per_second:,.0f} samples/s "
        f"({point.samples_per_second_low:,.0f}-{point.samples_per_second_high:,.0f}), "
        f"{point.step_seconds * 1000:.1f} ms a step"
    )


def _print_goodput(result: ThroughputResult, noise_scale: float) -> Goodput:

    found = goodput(result, noise_scale)
    console.print(
        f"[bold green]Goodput (throughput x statistical efficiency, Pollux) with B_simple {noise_scale:,.0f}: "
        f"best measured at batch {found.best_measured_batch_size}; the fitted line peaks at "
        f"{found.optimal_batch_size} (sqrt(B_simple x alpha / beta)).[/]"
    )
    return found


class LrScaling(str, Enum):
    linear = "linear"
    sqrt = "sqrt"
    none = "none"


class Goal(str, Enum):
    accuracy = "accuracy"
    speed = "speed"
    memory = "memory"


@app.command(
    "plan",
    epilog="Example: batchfit plan --micro-batch-size 16 --global-batch-tokens 32768 --seq-len 256 --base-lr 3e-4 --base-batch-size 65536",
)
@cli_errors
@sharded.parallel_options
def plan(
    workload: Annotated[
        str | None, typer.Argument(help="Measure the micro-batch on this workload (else give --micro-batch-size).")
    ] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="The largest micro-batch that fits, if known.")] = None,
    global_batch_size: Annotated[int | None, typer.Option(help="Target global batch in samples.")] = None,
    global_batch_tokens: Annotated[
        str | None,
        typer.Option(help="Target global batch in tokens (with --seq-len): a count, or 4M for 4 x 2**20."),
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sample.")] = None,
    devices: Annotated[
        int | None, typer.Option(help="Data-parallel devices (default: torch.distributed's world size, else 1).")
    ] = None,
    base_lr: Annotated[float | None, typer.Option(help="The learning rate tuned at --base-batch-size.")] = None,
    base_batch_size: Annotated[
        int | None, typer.Option(help="The batch --base-lr was tuned at (same unit as the target).")
    ] = None,
    lr_scaling: Annotated[
        LrScaling, typer.Option(help="linear (Goyal 2017), sqrt (Adam; Malladi 2022) or none.")
    ] = LrScaling.linear,
    warmup_epochs: Annotated[
        int | None, typer.Option(help="Learning-rate warmup epochs (else suggested from the scale).")
    ] = None,
    warmup_steps: Annotated[
        int | None, typer.Option(help="Learning-rate warmup in optimizer steps, instead of epochs.")
    ] = None,
    dataset_size: Annotated[int | None, typer.Option(help="Samples per epoch, for steps per epoch.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Epochs, for total steps.")] = None,
    goal: Annotated[
        Goal | None, typer.Option(help="accuracy, speed or memory: what the warnings and advice aim for.")
    ] = None,
    fine_tuning: Annotated[bool, typer.Option(help="Fine-tuning: small batch and learning rate.")] = False,
    model_family: Annotated[
        str | None, typer.Option(help="gpt2, bert, llama or resnet50-imagenet: a typical target if none is given.")
    ] = None,
    device: Annotated[str, typer.Option(help="Where to measure the micro-batch, with WORKLOAD.")] = "auto",
    margin: Annotated[
        str, typer.Option(help="Headroom kept when measuring: bytes, a size like 512MiB, or a fraction like 0.05.")
    ] = "0",
    keep_output: KeepOutput = True,
    model_settings: SetOption = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write BatchPlan.to_dict() here.")] = None,
    gpu: Annotated[
        str | None,
        typer.Option(help="Per rank, for a model built from its config: a GPU preset (h100-80gb) or a size (80GiB)."),
    ] = None,
    parallel: sharded.ParallelOptions = sharded.NO_PARALLEL_OPTIONS,
    activation_checkpointing: Annotated[
        str | None,
        typer.Option(
            help="none, selective, full, or several to compare (a model from its config; default none,full); "
            "one choice for a WORKLOAD of your own with --gpus (default none)."
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="With a model from its config and --gpus: confirm each traced answer with one rank's real trials "
            "at it and one above, on --device (auto: a simulated device of the --gpu capacity).",
        ),
    ] = False,
    debug: Debug = False,
) -> None:
    """Plan micro-batch, accumulation, learning rate and warmup for a global batch on N devices.

    With WORKLOAD the micro-batch is measured; when the plan accumulates, it is measured again with
    the window's gradients held through forward and backward (as a later micro-batch runs), and
    the plan uses that answer. An LLM preset or a config.json with --gpu and --gpus N (or --nodes
    and --gpus-per-node) is traced per rank under FSDP2 for each activation-checkpointing choice."""
    refuse_preset(device)
    if workload is not None and micro_batch_size is not None:
        raise InputError("give either --micro-batch-size N or a WORKLOAD to measure it on, not both")
    if workload is None:
        devices = _devices_without_workload(
            devices, parallel, gpu, device, margin, keep_output, activation_checkpointing
        )
    elif gpu is not None and device != "auto":
        raise InputError(
            f"give --gpu {gpu} (trace the workload for that GPU, nothing runs) or --device {device} (measure on it), not both"
        )
    check_outputs(json_path)
    settings = SearchSettings(margin=parse_margin(margin))  # checked before any work
    planning = functools.partial(
        plan_batch,
        global_batch_size=global_batch_size,
        global_batch_tokens=sharded.parse_tokens(global_batch_tokens),
        base_lr=base_lr,
        base_batch_size=base_batch_size,
        lr_scaling=lr_scaling.value,
        warmup_epochs=warmup_epochs,
        warmup_steps=warmup_steps,
        dataset_size=dataset_size,
        epochs=epochs,
        fine_tuning=fine_tuning,
        goal=goal.value if goal else None,
        model_family=model_family,
    )
    route = route_workload(workload, parallel.asked) if workload is not None else None
    ranks = None  # a workload of the user's own with --gpus: one rank's real trials measure it
    if route in (Route.CONFIG, Route.OWN_RANK):
        world = parallel.world()
        if devices is not None and devices != world[0]:
            raise InputError(f"--devices {devices} disagrees with the {world[0]} ranks of --gpus/--nodes: give one")
        if route is Route.CONFIG:
            if model_settings:
                raise InputError(NO_SETTINGS_FOR_CONFIG)
            choices = parallel.choices(activation_checkpointing or "none,full")
            if verify and parallel.cpu_offload:
                raise InputError(
                    "--verify runs real trials of one rank, and CPU offload cannot run for real on one device: "
                    "drop --verify or --cpu-offload"
                )
            _plan_sharded(
                planning, workload, gpu, seq_len or DEFAULT_SEQ_LEN, choices, json_path, device if verify else None
            )
            return
        ranks = parallel.choices(activation_checkpointing or "none")
        devices = world[0]
    elif workload is not None:
        parallel.refuse_unused()
        if activation_checkpointing is not None:
            raise InputError(
                "--activation-checkpointing applies to a model traced per rank: add --gpus N, or give an LLM preset"
            )
    if verify:
        raise InputError(
            "--verify confirms a plan traced on fake tensors: give a model from its config with --gpus and --gpu "
            "(a WORKLOAD's micro-batch is already measured by real trials)"
        )
    planning = functools.partial(planning, seq_len=seq_len, devices=devices)
    if workload is None:
        if micro_batch_size is None:
            raise InputError("give --micro-batch-size N, or a WORKLOAD to measure it on")
        result = planning(micro_batch_size=micro_batch_size)
    else:
        loaded = load_workload(
            workload, framework=None, seq_len=seq_len, only_accepted=True, settings=model_settings or ()
        )
        work = with_loop(loaded, keep_output)
        if ranks is not None:
            work, _ = rank_workload(workload, seq_len, ranks, 0, lambda: (work, {}))
        target = TraceDevice(gpu) if gpu is not None else device_for(work, device)
        if gpu is not None:
            console.print(
                f"Tracing {work.name} for {escape(preset(gpu).label if is_preset(gpu) else gpu)} on fake tensors: "
                "nothing runs on a GPU.",
                highlight=False,
            )
        found = plan_workload(
            work,
            lambda largest: planning(micro_batch_size=largest),
            settings,
            device=target,
            progress=ConsoleProgress(),
        )
        result = found.plan
    _print_plan(result)
    if json_path is not None:
        write_json(json_path, result.to_dict())


def _devices_without_workload(
    devices: int | None,
    parallel: sharded.ParallelOptions,
    gpu: str | None,
    device: str,
    margin: str,
    keep_output: bool,
    activation_checkpointing: str | None,
) -> int | None:
    """The devices a plan without a workload spreads over: ``--devices``, or ``--gpus``/``--nodes`` (the same
    number, given either way); every option that only a measured or traced workload reads is refused."""
    unused = [
        flag
        for flag, given in (
            (f"--gpu {gpu}", gpu is not None),
            (f"--device {device}", device != "auto"),
            (f"--margin {margin}", margin != "0"),
            ("--drop-output", not keep_output),
            ("--activation-checkpointing", activation_checkpointing is not None),
            ("--fsdp", parallel.fsdp),
            ("--hybrid-shard", parallel.hybrid_shard),
            ("--param-dtype", parallel.param_dtype is not None),
            ("--reduce-dtype", parallel.reduce_dtype is not None),
            ("--cpu-offload", parallel.cpu_offload),
        )
        if given
    ]
    if unused:
        raise InputError(
            f"{', '.join(unused)} {'apply' if len(unused) > 1 else 'applies'} to a WORKLOAD the plan measures or "
            "traces: give one (e.g. batchfit plan my_model.py:build --gpu a100-40gb), or drop "
            f"{'them' if len(unused) > 1 else 'it'}"
        )
    if parallel.gpus is None and parallel.nodes is None:
        return devices
    world = parallel.world()[0]
    if devices is not None and devices != world:
        raise InputError(f"--devices {devices} disagrees with the {world} GPUs of --gpus/--nodes: give one")
    return world


def _plan_sharded(
    planning: Callable[..., BatchPlan],
    workload: str,
    gpu: str | None,
    seq_len: int,
    choices: list[Parallelism],
    json_path: Path | None,
    verify_on: str | None = None,
) -> None:
    """The plan for a model built from its config (``batchfit.workflows.sharded_plan.plan_sharded``), printed and written;
    with ``verify_on`` (a device), each choice's answer confirmed by one rank's real trials."""
    if gpu is None:
        raise InputError("a sharded plan traces one rank on a GPU preset: give --gpu (e.g. --gpu h100-80gb)")
    verifier = verification_device(verify_on, capacity_of(gpu)[0]) if verify_on else None
    ranks = choices[0].world_size
    found = plan_sharded(
        workload,
        gpu,
        seq_len,
        choices,
        lambda largest: planning(micro_batch_size=largest, seq_len=seq_len, devices=ranks),
        verify_on=verifier,
        progress=ConsoleProgress(),
    )
    console.print(f"Planned with activation checkpointing {found.chosen.activation_checkpointing}.", highlight=False)
    _print_plan(found.plan)
    if json_path is not None:
        write_json(json_path, found.to_dict())


def _print_plan(result: BatchPlan) -> None:
    table = Table(title="Batch plan", title_justify="left", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    for key, value in result.to_dict()["batch_configuration"].items():
        if value is not None:
            table.add_row(key.replace("_", " "), f"{value:g}" if isinstance(value, float) else str(value))
    console.print(table)
    tokens = f" = {result.global_batch_tokens:,} tokens" if result.global_batch_tokens else ""
    console.print(
        f"[bold green]{result.micro_batch_size} per device x {result.gradient_accumulation_steps} accumulation steps x "
        f"{result.devices} device(s) = {result.global_batch_size} samples{tokens} per optimizer step.[/]"
    )
    for warning in result.warnings:
        console.print(f"[yellow]Warning:[/] {escape(warning)}")
    for advice in result.advice:
        console.print(f"[cyan]Advice:[/] {escape(advice)}")


@app.command("list-workloads", epilog="Example: batchfit list-workloads --framework mlx")
def list_workloads(
    framework: Annotated[
        Framework, typer.Option(help="torch, or mlx: the MLX built-ins (find runs them).")
    ] = Framework.torch,
) -> None:
    """Name the built-in workloads, one line each, and the LLM shapes estimate builds from their configs."""
    for name, line in describe_builtins(framework.value).items():
        console.print(f"[bold]{name:10}[/] {line}", highlight=False)
    if framework is Framework.torch:
        console.print("LLMs built from their published configs, on fake tensors (batchfit estimate NAME --gpus N):")
        for name in LLM_PRESETS:
            console.print(f"[bold]{name:12}[/] {preset_line(name)}", highlight=False)


def preset_line(name: str) -> str:
    """What the LLM preset ``name`` is: its layers, width and vocabulary, from its config."""

    config = LLM_PRESETS[name]
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    width = config.get("hidden_size", config.get("n_embd"))
    return f"{config['model_type']}: {layers} layers, width {width}, vocabulary {config['vocab_size']}"


from batchfit.cli import critical  # noqa: E402, F401  (registers critical)
from batchfit.cli import sweep  # noqa: E402, F401  (registers sweep and cache)
from batchfit.cli import tokens as tokens_command  # noqa: E402, F401  (registers tokens)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
