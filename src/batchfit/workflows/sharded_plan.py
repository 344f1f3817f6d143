"""A plan for a model built from its config, per rank under FSDP2 (``batchfit plan CONFIG --gpus N --gpu G``).

For each activation-checkpointing choice, one rank's largest micro-batch within the capacity is traced on
fake tensors; the plan takes no checkpointing where micro-batch 1 fits without it, else the choice that fits
the most, and says where another choice would need fewer accumulation steps. With a verification device, the
choices are timed there instead and the fastest is taken (``batchfit.workflows.sharded_timing``). When the plan accumulates, the
micro-batch is traced again with the window's gradient shards held (FSDP2 keeps them from one micro-batch to
the next). With a verification device, one rank's real trials check each traced answer
(``batchfit.workflows.verification``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.settings import Parallelism
from batchfit.planning.plan import BatchPlan
from batchfit.throughput.frontier_result import FrontierChoice
from batchfit.workflows.arguments import check_callable
from batchfit.workflows.arguments import check_capacity_spec
from batchfit.workflows.arguments import check_choices
from batchfit.workflows.arguments import check_model_spec
from batchfit.workflows.arguments import check_progress
from batchfit.workflows.arguments import check_size
from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.ranks import NOT_TRACED
from batchfit.workflows.ranks import capacity_of
from batchfit.workflows.ranks import describe_parallelism
from batchfit.workflows.ranks import held_gradient_bytes
from batchfit.workflows.ranks import host_line
from batchfit.workflows.ranks import traced_with_gradients_held
from batchfit.workflows.sharded_timing import choose_by_throughput
from batchfit.workflows.verdict import PlanVerification
from batchfit.workflows.verification import Found
from batchfit.workflows.verification import verify_accumulating
from batchfit.workflows.verification import verify_plan
from batchfit.workflows.workload_plan import Planner

RECOMPUTE_COST = {  # what each choice costs in backward, as the advice says it
    "full": "about a third more compute per step (every block's forward runs again in backward)",
    "selective": "some more compute per step (each block recomputes its cheap ops and every other matmul in backward)",
}


@dataclass(frozen=True)
class ShardedPlan:
    """The plan and what it came from: each choice's largest micro-batch per rank (``found``, verified sizes
    where a check ran), the ``chosen`` parallelism, the ``held`` micro-batch with the window's gradients held
    (``None`` without accumulation) and the real trials' ``verification`` (``None`` without one)."""

    plan: BatchPlan
    found: Found
    chosen: Parallelism
    capacity: str
    held: int | None = None
    verification: PlanVerification | None = None
    timed: list[FrontierChoice] | None = None
    """Each choice's planned micro-batch timed in one rank's real steps, where a device chose by throughput."""

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON with ``sharding``: the parallelism, the chosen checkpointing, and per choice the
        largest micro-batch per rank and the breakdown at it (and the verification, when one ran)."""
        document = self.plan.to_dict()
        document["sharding"] = {
            "parallelism": self.chosen.to_dict(),
            "activation_checkpointing": self.chosen.activation_checkpointing,
            "device": self.capacity,
            "per_rank": [
                {
                    "activation_checkpointing": parallelism.activation_checkpointing,
                    "largest_batch_size": largest.batch_size,
                    "peak_bytes": largest.estimate.peak_bytes,
                    "breakdown": dict(largest.estimate.breakdown),
                    **largest.estimate.host_part(),
                }
                for parallelism, largest in self.found
            ],
            "not_traced": list(NOT_TRACED),
        }
        if self.verification is not None:
            document["sharding"]["verification"] = self.verification.to_dict()
        if self.timed is not None:
            document["sharding"]["timed"] = [vars(choice) for choice in self.timed]
        return document


def measure_per_rank(
    workload: str, capacity: str, seq_len: int, choices: list[Parallelism], progress: Progress = SILENT
) -> Found:
    """The largest micro-batch per rank within ``capacity`` for each parallelism in ``choices``."""
    from batchfit.parallel.models import model_config

    model_config(workload)  # an unknown name or a file that is not a model config fails here in one line
    capacity_bytes, _ = capacity_of(capacity)
    found = []
    for parallelism in choices:
        with progress.working(f"Tracing one rank, activation checkpointing {parallelism.activation_checkpointing}"):
            found.append((parallelism, largest_batch_size(workload, seq_len, capacity_bytes, parallelism=parallelism)))
        progress.said(
            f"Traced {describe_parallelism(parallelism)}, activation checkpointing "
            f"{parallelism.activation_checkpointing}: the largest micro-batch per rank is {found[-1][1].batch_size}."
        )
    if found[0][1].estimate.host_peak_bytes is not None:  # the host holds the same state whatever the choice
        progress.said(host_line(found[0][1].estimate))
    return found


def choose_checkpointing(found: Found, seq_len: int, capacity: str) -> tuple[Parallelism, LargestBatch]:
    """The choice a plan uses: no activation checkpointing where a micro-batch of 1 fits without it
    (recomputing every block costs about a third more compute per step), else the choice that fits
    the most; a one-line error when none fits even 1."""
    fitting = [(parallelism, largest) for parallelism, largest in found if largest.batch_size >= 1]
    if not fitting:
        tried = ", ".join(parallelism.activation_checkpointing for parallelism, _ in found)
        raise InputError(
            f"not even micro-batch 1 x {seq_len} tokens fits per rank on {capacity} (activation checkpointing "
            f"{tried}): use more ranks, --activation-checkpointing full, a shorter --seq-len or --param-dtype bf16"
        )
    plain = [item for item in fitting if item[0].activation_checkpointing == "none"]
    return plain[0] if plain else max(fitting, key=lambda item: item[1].batch_size)


def checkpointing_advice(found: Found, chosen: Parallelism, plan: BatchPlan) -> list[str]:
    """Advice where another checkpointing choice would need fewer accumulation steps."""
    per_rank = -(-plan.target_samples // plan.devices)  # samples each rank must see per optimizer step
    advice = []
    for parallelism, largest in found:
        if parallelism is chosen or largest.batch_size <= plan.micro_batch_size:
            continue
        steps = -(-per_rank // largest.batch_size)
        if steps < plan.gradient_accumulation_steps:
            advice.append(
                f"activation checkpointing {parallelism.activation_checkpointing} fits {largest.batch_size} per rank: "
                f"{steps} accumulation step(s) instead of {plan.gradient_accumulation_steps}, for "
                + RECOMPUTE_COST[parallelism.activation_checkpointing]
            )
    return advice


def with_gradients_held(
    workload: str,
    capacity: str,
    seq_len: int,
    parallelism: Parallelism,
    largest: LargestBatch,
    progress: Progress = SILENT,
) -> int:
    """The largest micro-batch per rank when the accumulation window's gradients are alive through
    a later micro-batch: FSDP2 keeps each rank's reduced gradient shards from one micro-batch to the
    next, so the capacity left is smaller by their bytes (``state_bytes["gradients"]`` of the trace)."""
    gradients = held_gradient_bytes(largest)
    if gradients == 0:  # CPU offload: the gradient shards are held on the host
        return largest.batch_size
    capacity_bytes, _ = capacity_of(capacity)
    with progress.working("Tracing again with the accumulation window's gradients held"):
        held = traced_with_gradients_held(workload, seq_len, capacity_bytes, parallelism, largest)
    progress.said(
        f"With the window's gradient shards held ({format_bytes(gradients)} per rank), the largest micro-batch "
        f"per rank is {held.batch_size}."
    )
    if held.batch_size < 1:
        raise InputError(
            f"micro-batch 1 fits per rank, but not with the accumulation window's gradients held "
            f"({format_bytes(gradients)}): use more ranks or --activation-checkpointing full"
        )
    return held.batch_size


def plan_sharded(
    workload: str,
    capacity: str,
    seq_len: int,
    choices: list[Parallelism],
    planner: Planner,
    *,
    verify_on: Any = None,
    progress: Progress = SILENT,
) -> ShardedPlan:
    """The plan for ``workload`` (an LLM preset or a config.json) per rank on ``capacity`` (a GPU preset or a
    size), over the activation-checkpointing ``choices`` (one ``Parallelism`` each, one world); ``planner``
    makes the plan from a micro-batch per rank. With ``verify_on`` (a device), one rank's real trials check
    each traced answer first, and the plan's micro-batch as a later one of the window when it accumulates.

    >>> from batchfit.planning.plan import plan_batch
    >>> ranks = [Parallelism(world_size=4, activation_checkpointing="none")]
    >>> found = plan_sharded("examples/llama-tiny.json", "8MiB", 64, ranks,
    ...                      lambda size: plan_batch(micro_batch_size=size, global_batch_size=64, devices=4))
    >>> found.chosen.activation_checkpointing, found.plan.global_batch_size
    ('none', 64)
    """
    check_model_spec(workload)
    check_capacity_spec(capacity)
    check_size("seq_len", seq_len)
    choices = check_choices(choices)
    check_callable(
        "planner", planner, "a micro-batch per rank -> a BatchPlan, e.g. lambda b: plan_batch(micro_batch_size=b)"
    )
    check_progress(progress)
    found = measure_per_rank(workload, capacity, seq_len, choices, progress)
    verification = None
    if verify_on is not None:  # a traced answer that fails its real trial gives way to the largest verified size
        verification, found = verify_plan(workload, seq_len, found, verify_on, progress)
    chosen, largest = choose_checkpointing(found, seq_len, capacity)
    timed = None
    if verify_on is not None and sum(item[1].batch_size >= 1 for item in found) > 1:  # a device to time them on
        (chosen, largest), timed = choose_by_throughput(workload, seq_len, found, planner, verify_on, progress)
    plan, held = planner(largest.batch_size), None
    if plan.gradient_accumulation_steps > 1:  # a later micro-batch runs with the window's sharded gradients
        held = with_gradients_held(workload, capacity, seq_len, chosen, largest, progress)
        plan = planner(held)
        if verification is not None:  # the plan's micro-batch, and one above the largest, as later micro-batches
            verification.accumulating += verify_accumulating(
                workload, seq_len, chosen, plan.micro_batch_size, held, verify_on, progress
            )
    plan = dataclasses.replace(plan, advice=plan.advice + checkpointing_advice(found, chosen, plan))
    return ShardedPlan(plan, found, chosen, capacity, held, verification, timed)
