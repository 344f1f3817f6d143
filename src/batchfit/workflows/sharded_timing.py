"""The per-rank plan's checkpointing choice by measured throughput, where a device is there to time it
(``batchfit plan CONFIG --gpus N --gpu G --verify``).

Each choice that fits is planned (its micro-batch per rank and accumulation steps for the global batch), and
one rank's real steps at that micro-batch are timed on the verification device (FSDP2 over the fake process
group, as the verification runs it). Each choice's samples/s per rank is its micro-batch over the median timed
step; the choice recomputing least within ``TOLERANCE`` of the fastest is taken (``choose`` of the
checkpointing frontier). Each micro-batch is timed as a full step, optimizer step included, as the frontier
times it. Without a device the plan chooses by memory, as before (``choose_checkpointing``).
"""

from __future__ import annotations

import statistics
from typing import Any

from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.settings import Parallelism
from batchfit.throughput.frontier_result import FrontierChoice
from batchfit.throughput.frontier_result import choose
from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.verification import Found
from batchfit.workflows.workload_plan import Planner

TOLERANCE = 0.05
WARMUP_STEPS, TIMED_STEPS = 1, 3


def _timed_choice(
    workload: str, seq_len: int, parallelism: Parallelism, micro: int, steps: int, device: Any
) -> FrontierChoice:
    from batchfit.parallel.one_rank import probe_rank_batch_size

    trial = probe_rank_batch_size(
        workload, seq_len, micro, parallelism=parallelism, device=device, steps=WARMUP_STEPS + TIMED_STEPS
    )
    timed = trial.step_seconds[WARMUP_STEPS:]
    seconds = statistics.median(timed) if trial.fits and timed else None
    rate = micro / seconds if seconds else None
    return FrontierChoice(
        parallelism.activation_checkpointing,
        micro,
        steps,
        parallelism.world_size,
        None,
        rate,
        seconds,
        trial.peak_bytes,
    )


def choose_by_throughput(
    workload: str, seq_len: int, found: Found, planner: Planner, device: Any, progress: Progress = SILENT
) -> tuple[tuple[Parallelism, LargestBatch], list[FrontierChoice]]:
    """The choice whose planned micro-batch runs the most samples/s in one rank's real steps on ``device`` (the
    least recomputing within ``TOLERANCE``), and each choice as timed (``samples_per_second`` per rank)."""
    timed = []
    for parallelism, largest in found:
        if largest.batch_size < 1:
            continue
        plan = planner(largest.batch_size)
        with progress.working(
            f"Timing one rank's steps, activation checkpointing {parallelism.activation_checkpointing}"
        ):
            choice = _timed_choice(
                workload, seq_len, parallelism, plan.micro_batch_size, plan.gradient_accumulation_steps, device
            )
        rate = f"{choice.samples_per_second:,.1f} samples/s per rank" if choice.samples_per_second else "did not run"
        progress.said(
            f"Timed on {device.name}: activation checkpointing {choice.policy} at micro-batch "
            f"{choice.micro_batch_size} x {choice.accumulation_steps}: {rate}."
        )
        timed.append(choice)
    chosen, _reason = choose(timed, TOLERANCE)
    pair = next(item for item in found if item[0].activation_checkpointing == chosen.policy)
    return pair, timed
