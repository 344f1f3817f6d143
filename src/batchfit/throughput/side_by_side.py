"""The policies' candidates timed side by side: each policy's best way to the global batch was found from its own
timings, taken minutes apart from the other policies'; on a device whose speed drifts (a shared machine, a GPU
warming up) that compares the drift as much as the policies. So the candidates are timed again in turns, one
round after another (A, B, C, A, B, C, ...), each round a few steps of each, and the choice is made from those
steps, which saw the same conditions. A window of accumulation steps runs its optimizer step once: its time is
the micro-batches' full steps less the optimizer steps of all but the last (``window_seconds``), each optimizer
step timed on its own in the same steps (``Trial.optimizer_seconds``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from batchfit.search.prober import Prober
from batchfit.search.runner import usable_bytes
from batchfit.search.settings import SearchSettings
from batchfit.step.checkpointing import checkpointing
from batchfit.step.workload import Workload
from batchfit.throughput.frontier_result import CheckpointingFrontier
from batchfit.throughput.frontier_result import FrontierChoice
from batchfit.throughput.frontier_result import choose
from batchfit.throughput.frontier_result import window_seconds
from batchfit.throughput.result import rate

ROUNDS, WARMUP_STEPS, TIMED_STEPS = 5, 1, 3


def _steps(
    workload: Workload, device: Any, candidate: FrontierChoice, limit: int | None
) -> tuple[list[float], list[float]]:
    """One round of ``candidate``: its policy applied, its micro-batch's timed steps and their optimizer steps
    (none if it did not fit)."""
    steps = WARMUP_STEPS + TIMED_STEPS
    with (
        checkpointing(workload.model, candidate.policy),
        Prober(device.prepare(workload), device, steps=steps, limit_bytes=limit) as prober,
    ):
        trial = prober.probe(candidate.micro_batch_size)
    if not trial.fits:
        return [], []
    return list(trial.step_seconds[WARMUP_STEPS:]), list(trial.optimizer_seconds[WARMUP_STEPS:])


def _retimed(candidate: FrontierChoice, seconds: list[float], optimizer: list[float]) -> FrontierChoice:
    if not seconds:
        return candidate
    step = statistics.median(seconds)
    optimizer_step = statistics.median(optimizer) if optimizer else None
    window = window_seconds(step, optimizer_step, candidate.accumulation_steps)
    per_device = rate(candidate.micro_batch_size * candidate.accumulation_steps, window)
    return dataclasses.replace(
        candidate,
        samples_per_second=per_device * candidate.devices,
        step_seconds=step,
        optimizer_seconds=optimizer_step,
    )


def side_by_side(
    workload: Workload,
    frontier: CheckpointingFrontier,
    device: Any,
    settings: SearchSettings | None = None,
    rounds: int = ROUNDS,
) -> CheckpointingFrontier:
    """``frontier`` with its candidates timed again in turns (``rounds`` rounds) and chosen from those timings;
    as it was where there is nothing to compare (fewer than two candidates, or nothing timed)."""
    candidates = frontier.candidates
    if not frontier.timed or len(candidates) < 2:
        return frontier
    _capacity, limit = usable_bytes(device, (settings or SearchSettings()).margin)
    seconds: list[list[float]] = [[] for _ in candidates]
    optimizer: list[list[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        for index, candidate in enumerate(candidates):
            steps, optimizer_steps = _steps(workload, device, candidate, limit)
            seconds[index] += steps
            optimizer[index] += optimizer_steps
    retimed = [_retimed(c, s, o) for c, s, o in zip(candidates, seconds, optimizer, strict=True)]
    choice, reason = choose(retimed, frontier.tolerance)
    note = (
        f"the candidates were timed again side by side ({rounds} rounds of {TIMED_STEPS} steps each), as chosen; "
        "a window of accumulation steps is charged one optimizer step"
    )
    return dataclasses.replace(
        frontier, candidates=retimed, choice=choice, reason=reason, notes=[*frontier.notes, note]
    )
