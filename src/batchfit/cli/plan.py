"""The body of ``batchfit plan``: micro-batch, accumulation, learning rate and warmup for a global batch: it imports the library (and torch), so the command's face
(``batchfit.cli.commands``) imports it only when the command runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any

from rich.markup import escape
from rich.table import Table

from batchfit.cli import sharded
from batchfit.cli.common import NO_SETTINGS_FOR_CONFIG
from batchfit.cli.common import Goal
from batchfit.cli.common import LrScaling
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import parse_margin
from batchfit.cli.common import write_json
from batchfit.cli.sharded import ParallelOptions
from batchfit.devices.presets import is_preset
from batchfit.devices.presets import preset
from batchfit.devices.presets import refuse_preset
from batchfit.errors import InputError
from batchfit.planning.plan import BatchPlan
from batchfit.planning.plan import plan_batch
from batchfit.workflows.routing import DEFAULT_SEQ_LEN
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import route_workload

if TYPE_CHECKING:
    from batchfit.parallel.settings import Parallelism


def run_plan(
    *,
    workload: str | None,
    micro_batch_size: int | None,
    global_batch_size: int | None,
    global_batch_tokens: str | None,
    seq_len: int | None,
    devices: int | None,
    base_lr: float | None,
    base_batch_size: int | None,
    lr_scaling: LrScaling,
    warmup_epochs: int | None,
    warmup_steps: int | None,
    dataset_size: int | None,
    epochs: int | None,
    goal: Goal | None,
    fine_tuning: bool,
    model_family: str | None,
    device: str,
    margin: str,
    keep_output: bool,
    model_settings: list[str] | None,
    json_path: Path | None,
    gpu: str | None,
    parallel: ParallelOptions,
    activation_checkpointing: str | None,
    verify: bool,
    checkpointing: str | None = None,
    debug: bool = False,
) -> None:
    """The body of ``batchfit plan`` (see its help): plan micro-batch, accumulation, learning rate and warmup for a global batch on N devices."""
    refuse_preset(device)
    if checkpointing is not None:
        _check_frontier_options(checkpointing, workload, global_batch_size, parallel)
    if workload is not None and micro_batch_size is not None:
        raise InputError("give either --micro-batch-size N or a WORKLOAD to measure it on, not both")
    if workload is None:
        devices = _devices_without_workload(
            devices, parallel, gpu, device, margin, keep_output, activation_checkpointing
        )
    elif (
        gpu is not None
        and device != "auto"
        and route_workload(workload, parallel.asked) is not Route.CONFIG  # there --device is --verify's
    ):
        raise InputError(
            f"give --gpu {gpu} (trace the workload for that GPU, nothing runs) or --device {device} (measure on it), not both"
        )
    check_outputs(json_path)
    if workload is not None:  # the library and torch load only where a workload is measured or traced
        from batchfit.search.settings import SearchSettings

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
            if device != "auto" and not verify:
                raise InputError(
                    f"--device {device} is where --verify runs one rank's real trials: add --verify, or drop --device"
                )
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
        from batchfit.cli.loading import with_loop
        from batchfit.cli.progress import ConsoleProgress
        from batchfit.cli.workloads import load_workload
        from batchfit.devices.trace import TraceDevice
        from batchfit.search.runner import device_for
        from batchfit.workflows.rank_workloads import rank_workload
        from batchfit.workflows.workload_plan import plan_workload

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
        if checkpointing is not None:
            result, frontier = _plan_by_frontier(planning, work, target, checkpointing, settings, global_batch_size)
            _print_plan(result)
            if json_path is not None:
                write_json(json_path, {**result.to_dict(), "activation_checkpointing": frontier.to_dict()})
            return
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


def _check_frontier_options(
    checkpointing: str, workload: str | None, global_batch_size: int | None, parallel: ParallelOptions
) -> None:
    """``--checkpointing`` checked before any work: a WORKLOAD of one's own on one device, a global batch."""
    from batchfit.cli.frontier import check_policy_spec

    check_policy_spec(checkpointing)
    if workload is None:
        raise InputError(
            "--checkpointing measures each policy on a WORKLOAD: give one (batchfit plan my_model.py:build ...)"
        )
    if route_workload(workload, parallel.asked) is not Route.OWN:
        raise InputError(
            "--checkpointing measures a WORKLOAD of your own on one device: for a model traced per rank, give "
            "--activation-checkpointing none,selective,full"
        )
    if global_batch_size is None:
        raise InputError("--checkpointing plans for a global batch in samples: give --global-batch-size N")


def _plan_by_frontier(
    planning: Callable[..., BatchPlan], work: Any, target: Any, spec: str, settings: Any, global_batch_size: int
) -> tuple[BatchPlan, Any]:
    """The plan with the policy, micro-batch and accumulation that reach the global batch fastest."""
    from batchfit.cli.frontier import run_frontier
    from batchfit.planning.plan import world_size

    devices = planning.keywords.get("devices") or world_size()
    frontier = run_frontier(work, target, spec, settings=settings, global_batch_size=global_batch_size, devices=devices)
    plan = planning(micro_batch_size=frontier.choice.micro_batch_size)
    console.print(f"Planned with activation checkpointing {escape(frontier.choice.policy)}.", highlight=False)
    return plan, frontier


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
    from batchfit.cli.progress import ConsoleProgress
    from batchfit.workflows.ranks import capacity_of
    from batchfit.workflows.sharded_plan import plan_sharded
    from batchfit.workflows.verification import verification_device

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
