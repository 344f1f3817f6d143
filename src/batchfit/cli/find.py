"""The body of ``batchfit find``: the search, trial by trial, with live lines: it imports the library (and torch), so the command's face
(``batchfit.cli.commands``) imports it only when the command runs."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from batchfit.cli import one_rank
from batchfit.cli.common import NO_SETTINGS_FOR_CONFIG
from batchfit.cli.common import Amp
from batchfit.cli.common import Framework
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import errors
from batchfit.cli.common import header_line
from batchfit.cli.common import parse_margin
from batchfit.cli.common import print_answer
from batchfit.cli.common import write_json
from batchfit.cli.loading import load_for_cli
from batchfit.cli.report import print_result
from batchfit.cli.report import result_document
from batchfit.cli.report import trials_table
from batchfit.cli.sharded import ParallelOptions
from batchfit.cli.snapshot_trials import SHARDED_SNAPSHOT
from batchfit.cli.snapshot_trials import check_snapshot_output
from batchfit.cli.snapshot_trials import write_memory_snapshot
from batchfit.devices.base import Device
from batchfit.devices.presets import refuse_preset
from batchfit.errors import InputError
from batchfit.search.evidence import before_any_trial
from batchfit.search.result import SearchResult
from batchfit.search.runner import device_for
from batchfit.search.runner import search_workload
from batchfit.search.runner import traces_first
from batchfit.search.settings import SearchSettings
from batchfit.search.soak import SoakSettings
from batchfit.search.soak import check_soak_device
from batchfit.search.soak import soaked_result
from batchfit.search.soak_result import soak_summary
from batchfit.search.trial import Trial
from batchfit.workflows.rank_workloads import rank_workload
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import route_workload


def run_find(
    *,
    workload: str,
    device: str,
    strategy: str,
    min_batch_size: int,
    max_batch_size: int | None,
    margin: str,
    max_trials: int | None,
    max_seconds: float | None,
    trace: bool | None,
    cache: bool,
    cache_dir: Path | None,
    seq_len: int | None,
    image_size: int | None,
    amp: Amp | None,
    keep_output: bool,
    framework: Framework | None,
    model_settings: list[str] | None,
    json_path: Path | None,
    plot: Path | None,
    quiet: bool,
    parallel: ParallelOptions,
    activation_checkpointing: str,
    rank: int,
    debug: bool,
    memory_snapshot: Path | None = None,
    soak: int | None = None,
    eval_every: int | None = None,
) -> None:
    """The body of ``batchfit find`` (see its help): find the largest batch size that really fits: every answer is a size a trial ran."""
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
    soaking = soak_settings(soak, eval_every, dev, route is Route.OWN)
    if memory_snapshot is not None:
        if route is not Route.OWN:
            raise InputError(SHARDED_SNAPSHOT)
        check_snapshot_output(memory_snapshot, dev)
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
    if soaking is not None:
        result = soaked_result(result, work, soaking, device=dev, margin=parse_margin(margin))
    if quiet:
        print_answer(result.batch_size)
    else:
        print_result(console, result)
        if soaking is not None:
            console.print(escape(soak_summary(result.extra["soak"], soaking.steps)))
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
    if memory_snapshot is not None:  # the answer's trial, run again
        write_memory_snapshot(work, dev, result.batch_size, memory_snapshot, quiet=quiet)


def soak_settings(soak: int | None, eval_every: int | None, dev: Device, own: bool) -> SoakSettings | None:
    """``--soak`` and ``--eval-every`` checked before any trial (``None``: no soak asked)."""
    if soak is None:
        if eval_every is not None:
            raise InputError("--eval-every says when a soak evaluates: give --soak too, e.g. --soak 1000")
        return None
    if not own:
        raise InputError("--soak replays one device's allocator: drop it with --gpus, or soak a workload of your own")
    settings = SoakSettings(soak, eval_every)
    check_soak_device(dev)
    return settings


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
