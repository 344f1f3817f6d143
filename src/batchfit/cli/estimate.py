"""The body of ``batchfit estimate``: memory on a GPU you do not have, traced on fake tensors: it imports the library (and torch), so the command's face
(``batchfit.cli.commands``) imports it only when the command runs."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any

from rich.markup import escape

from batchfit._version import versions
from batchfit.cli import one_rank
from batchfit.cli import sharded
from batchfit.cli.common import NO_SETTINGS_FOR_CONFIG
from batchfit.cli.common import Allocator
from batchfit.cli.common import Amp
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import errors
from batchfit.cli.common import parse_margin
from batchfit.cli.common import print_answer
from batchfit.cli.common import write_json
from batchfit.cli.loading import load_for_cli
from batchfit.cli.progress import ConsoleProgress
from batchfit.cli.report import breakdown_table
from batchfit.cli.report import print_result
from batchfit.cli.report import result_document
from batchfit.cli.sharded import ParallelOptions
from batchfit.cli.snapshot_trials import SHARDED_SNAPSHOT
from batchfit.cli.snapshot_trials import check_snapshot_output
from batchfit.cli.snapshot_trials import write_memory_snapshot
from batchfit.devices.presets import preset
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import tracing
from batchfit.devices.trace import undercount_message
from batchfit.devices.units import format_bytes
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.parallel.copied import ShardedCopy
from batchfit.search.estimate import MemoryEstimate
from batchfit.search.estimate import estimate_workload
from batchfit.search.result import SearchResult
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.search.trial import Trial
from batchfit.step.builtin_workloads import BUILTIN_WORKLOADS
from batchfit.workflows.rank_workloads import rank_workload
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import route_workload
from batchfit.workflows.sharded_estimate import estimate_own_rank


def run_estimate(
    *,
    workload: str,
    gpu: str | None,
    capacity: str | None,
    reserve: str | None,
    allocator: Allocator | None,
    margin: str,
    accumulating: bool,
    batch_size: int | None,
    seq_len: int | None,
    image_size: int | None,
    amp: Amp | None,
    keep_output: bool,
    model_settings: list[str] | None,
    json_path: Path | None,
    plot: Path | None,
    quiet: bool,
    parallel: ParallelOptions,
    activation_checkpointing: str,
    debug: bool,
    memory_snapshot: Path | None = None,
) -> None:
    """The body of ``batchfit estimate`` (see its help): estimate memory without the hardware: the largest batch that fits on a GPU, and a breakdown."""

    if (gpu is None) == (capacity is None):
        raise InputError("give exactly one of --gpu (e.g. --gpu a100-40gb) or --capacity (e.g. --capacity 40GiB)")
    if batch_size is not None and batch_size < 1:
        raise InputError(f"--batch-size must be a positive integer, got {batch_size}")
    route = route_workload(workload, parallel.asked)
    if memory_snapshot is not None and route is not Route.OWN:
        raise InputError(SHARDED_SNAPSHOT)
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
    if memory_snapshot is not None:
        check_snapshot_output(memory_snapshot, tracer)
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
    if memory_snapshot is not None:  # the traced trial at the answer, or at --batch-size
        write_memory_snapshot(work, searched, at, memory_snapshot, quiet=quiet)


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
