"""The body of ``batchfit optimal``: step time across batch sizes, and the throughput-optimal batch: it imports the library (and torch), so the command's face
(``batchfit.cli.commands``) imports it only when the command runs."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from batchfit._version import versions
from batchfit.cli.common import Amp
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import header_line
from batchfit.cli.common import write_json
from batchfit.cli.frontier import check_policy_spec
from batchfit.cli.loading import load_for_cli
from batchfit.cli.report import throughput_table
from batchfit.devices.presets import refuse_preset
from batchfit.devices.resolve import resolve_device
from batchfit.planning.noise import Goodput
from batchfit.planning.noise import check_noise_scale
from batchfit.planning.noise import goodput
from batchfit.throughput import ThroughputPoint
from batchfit.throughput import ThroughputResult
from batchfit.throughput import check_max_seconds
from batchfit.throughput import optimal_for_workload


def run_optimal(
    *,
    workload: str,
    device: str,
    max_batch_size: int | None,
    tolerance: float,
    safety_fraction: float | None,
    timing_warmup_steps: int,
    timed_steps: int,
    noise_scale: float | None,
    seq_len: int | None,
    image_size: int | None,
    amp: Amp | None,
    keep_output: bool,
    model_settings: list[str] | None,
    json_path: Path | None,
    plot: Path | None,
    max_seconds: float | None,
    checkpointing: str | None = None,
    debug: bool = False,
) -> None:
    """The body of ``batchfit optimal`` (see its help): maximum is not optimal: time steps across batch sizes and pick the throughput-optimal one."""
    refuse_preset(device)
    check_max_seconds(max_seconds)
    if noise_scale is not None:
        check_noise_scale(noise_scale)  # before the search, not after it
    if checkpointing is not None:
        check_policy_spec(checkpointing, max_seconds=max_seconds, noise_scale=noise_scale, safety=safety_fraction)
    work, options = load_for_cli(workload, seq_len, image_size, amp, keep_output=keep_output, settings=model_settings)
    dev = resolve_device(device, work.model)
    check_outputs(json_path, plot)
    if checkpointing is not None:
        from batchfit.cli.frontier import run_frontier

        frontier = run_frontier(
            work,
            dev,
            checkpointing,
            max_batch_size=max_batch_size,
            tolerance=tolerance,
            timing_warmup_steps=timing_warmup_steps,
            timed_steps=timed_steps,
        )
        if json_path is not None:
            write_json(
                json_path,
                {"workload": {"name": work.name, "options": options}, **frontier.to_dict(), "versions": versions()},
            )
        if plot is not None:
            from batchfit.cli.plots import plot_frontier

            plot_frontier(frontier, plot)
        return
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
