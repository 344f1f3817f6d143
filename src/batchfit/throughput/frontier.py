"""The fastest way to a global batch: micro-batch x activation checkpointing, measured on the model itself.

Recomputing activations costs compute and buys memory, which buys a larger micro-batch and fewer accumulation
steps; whether that pays depends on the model and the device. For each policy (``batchfit.step.checkpointing``,
applied to the model for its measurement and undone after it): the largest micro-batch is searched (real trials,
or the trace for a GPU preset), and where a target global batch accumulates, the largest as a later micro-batch
of the window (its gradients held); then steps are timed across micro-batches by the optimal-batch machinery
(``optimal_for_workload``), including the micro-batches that split the global batch exactly. Each policy's best
split is then timed again beside the others', in turns (``batchfit.throughput.side_by_side``), and the choice is
made from those timings by ``batchfit.throughput.frontier_result`` (see there for the rule and what it counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch

from batchfit.bounds import check_size
from batchfit.devices.resolve import resolve_device
from batchfit.devices.trace import TraceDevice
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.step.checkpointing import check_applicable
from batchfit.step.checkpointing import checkpointing
from batchfit.step.checkpointing import parse_policies
from batchfit.step.workload import Workload
from batchfit.throughput.frontier_result import CheckpointingFrontier
from batchfit.throughput.frontier_result import PolicyFrontier
from batchfit.throughput.frontier_result import choose
from batchfit.throughput.frontier_result import divisors_up_to
from batchfit.throughput.frontier_result import policy_candidate
from batchfit.throughput.optimal import optimal_for_workload
from batchfit.throughput.result import ThroughputPoint
from batchfit.throughput.side_by_side import side_by_side

PolicyCallback = Callable[[PolicyFrontier], None]
SPLITS_TIMED = 3  # per policy, the largest exact splits of the global batch that fit, timed besides the grid


def _per_device(global_batch_size: int | None, devices: int) -> int | None:
    check_size("devices", devices)
    if global_batch_size is None:
        return None
    check_size("global_batch_size", global_batch_size)
    if global_batch_size % devices:
        raise InputError(
            f"global_batch_size {global_batch_size} does not divide among {devices} devices: give a multiple of {devices}"
        )
    return global_batch_size // devices


def _largest(workload: Any, settings: SearchSettings, device: Any) -> tuple[int, int | None]:
    """The largest batch of ``workload`` and its peak, or ``(0, None)`` where even the smallest does not fit."""
    try:
        found = search_workload(workload, settings, device=device)
    except NoBatchFitsError:
        return 0, None
    peak = max((t.peak_bytes or 0 for t in found.trials if t.batch_size == found.batch_size and t.fits), default=None)
    return found.batch_size, peak or None


def _splits_to_time(per_device: int | None, largest: int, held: int | None) -> list[int]:
    """The micro-batches a plan for the global batch could use: the whole per-device batch where it fits, and
    the largest exact splits within the accumulating limit."""
    if per_device is None:
        return []
    whole = [per_device] if per_device <= largest else []
    return whole + divisors_up_to(per_device, held if held is not None else largest)[:SPLITS_TIMED]


def _measure(
    workload: Workload,
    policy: str,
    settings: SearchSettings,
    device: Any,
    per_device: int | None,
    timing: dict[str, Any],
) -> PolicyFrontier:
    """One policy, applied for its measurement and undone after it."""
    with checkpointing(workload.model, policy):
        largest, peak = _largest(workload, settings, device)
        if largest < 1:
            return PolicyFrontier(policy, 0)
        held = None
        if per_device is not None and per_device > largest:  # the plan accumulates: a later micro-batch holds more
            held, _ = _largest(
                dataclasses.replace(workload, accumulating=True), settings.replace(max_batch_size=largest), device
            )
        if isinstance(device, TraceDevice):
            return PolicyFrontier(policy, largest, held, peak)
        sizes = _splits_to_time(per_device, largest, held)
        capped = settings.replace(max_batch_size=largest)
        result = optimal_for_workload(workload, capped, device=device, also_time=sizes, **timing)
        return PolicyFrontier(policy, largest, held, peak, result)


def frontier_for_workload(
    workload: Workload,
    policies: str | Sequence[str] = "auto",
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    global_batch_size: int | None = None,
    devices: int = 1,
    tolerance: float = 0.05,
    timing_warmup_steps: int = 2,
    timed_steps: int = 5,
    refine_rounds: int = 3,
    extra_timed_steps: int | None = None,
    on_policy: PolicyCallback | None = None,
    on_point: Callable[[ThroughputPoint], None] | None = None,
    **options: Any,
) -> CheckpointingFrontier:
    """``checkpointing_frontier`` for a ``Workload``: ``settings`` and ``options`` say how each largest
    micro-batch is searched, as in ``search_workload``; the timing keywords are ``optimal_for_workload``'s;
    ``on_policy`` hears of each policy as it is measured."""
    if not isinstance(workload, Workload):
        raise InputError(f"the checkpointing frontier measures a batchfit.Workload, got {type(workload).__name__}")
    if workload.mode != "train":
        raise InputError(f"activation checkpointing saves memory in training: the workload's mode is {workload.mode!r}")
    names = parse_policies(policies, workload.model)
    check_applicable(workload.model, names)  # before any measurement
    per_device = _per_device(global_batch_size, devices)
    if not 0 <= tolerance < 1:
        raise InputError(f"tolerance must be in [0, 1), got {tolerance=}")
    s = SearchSettings.of(settings, **options)
    dev = resolve_device(device, workload.model)
    timing = {
        "tolerance": tolerance,
        "timing_warmup_steps": timing_warmup_steps,
        "timed_steps": timed_steps,
        "refine_rounds": refine_rounds,
        "extra_timed_steps": extra_timed_steps,
    }
    measured = []
    for name in names:
        measured.append(_measure(workload, name, s, dev, per_device, {**timing, "on_point": on_point}))
        if on_policy is not None:
            on_policy(measured[-1])
    return side_by_side(workload, _assemble(measured, dev, global_batch_size, devices, tolerance), dev, s)


def _assemble(
    measured: list[PolicyFrontier], device: Any, global_batch_size: int | None, devices: int, tolerance: float
) -> CheckpointingFrontier:
    candidates = [c for f in measured if (c := policy_candidate(f, global_batch_size, devices)) is not None]
    if not candidates:
        tried = ", ".join(f.policy for f in measured)
        raise NoBatchFitsError(
            f"no micro-batch fits on {device.name} with any activation checkpointing tried ({tried}): use AMP, "
            "a smaller model or sequence, or more memory",
            [],
        )
    choice, reason = choose(candidates, tolerance)
    timed = not isinstance(device, TraceDevice)
    notes = [] if timed else ["nothing was timed on a trace: the choice is by memory"]
    if timed and global_batch_size is not None and any(c.accumulation_steps > 1 for c in candidates):
        notes.append(
            "each micro-batch was timed as a full step, optimizer step included: an optimizer step of a "
            "micro-batches counts a of them (an upper bound where it accumulates)"
        )
    return CheckpointingFrontier(
        measured, candidates, choice, reason, device.name, timed, global_batch_size, devices, tolerance, notes
    )


def checkpointing_frontier(
    model: torch.nn.Module,
    sample_batch: Any,
    *,
    policies: str | Sequence[str] = "auto",
    global_batch_size: int | None = None,
    devices: int = 1,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: DeviceSpec = None,
    tolerance: float = 0.05,
    **options: Any,
) -> CheckpointingFrontier:
    """Which activation checkpointing and which micro-batch reach ``global_batch_size`` fastest on ``device``.

    Each policy in ``policies`` (``"auto"``, or a comma-separated string or list of ``none``, ``selective``,
    ``selective-matmuls``, ``full``, ``full:K``, ``hf``: ``batchfit.step.checkpointing``) is applied to
    ``model`` without editing it, measured, and undone (the model is bitwise as before afterwards): its
    largest micro-batch, then samples/s timed across micro-batches. With ``global_batch_size`` (over
    ``devices`` data-parallel devices) the choice is the (policy, micro-batch, accumulation) with the most
    samples/s, the least recomputing within ``tolerance``; without it, each policy's throughput-optimal
    micro-batch. On a ``TraceDevice`` nothing is timed and the choice is by memory. ``options`` are the
    search's (``min_batch_size``, ``max_batch_size``, ``margin``, ``timed_steps``, ...).

    >>> import torch, batchfit as bf
    >>> torch.manual_seed(0) and None
    >>> blocks = [torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    ...           for _ in range(4)]
    >>> found = bf.checkpointing_frontier(torch.nn.Sequential(*blocks), torch.randn(4, 32),
    ...                                   loss_fn=lambda out, batch: out.square().mean(), policies="none,full",
    ...                                   global_batch_size=64, device=bf.TraceDevice("320KiB"))
    >>> [(p.policy, p.largest_batch_size > 0) for p in found.policies], found.timed
    ([('none', True), ('full', True)], False)
    >>> found.choice.micro_batch_size * found.choice.accumulation_steps
    64

    On a ``SimulatedDevice`` (or a GPU) each policy's steps are timed too, and ``found.choice`` is the fastest.
    """
    timing_keys = ("timing_warmup_steps", "timed_steps", "refine_rounds", "extra_timed_steps", "on_policy", "on_point")
    timing = {key: options.pop(key) for key in timing_keys if key in options}
    workload = Workload(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, amp_dtype=amp_dtype)
    return frontier_for_workload(
        workload,
        policies,
        device=device,
        global_batch_size=global_batch_size,
        devices=devices,
        tolerance=tolerance,
        **timing,
        **options,
    )
