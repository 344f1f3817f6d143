"""Estimates per rank without the hardware (``batchfit estimate ... --gpus N``).

Two routes: a model built from its config is traced with torch's ``fully_shard`` for each
activation-checkpointing choice (the largest micro-batch per rank, and the breakdown at the micro-batch asked
about); a workload of the user's own is copied, sharded, and one rank's trials run on a trace device (the
largest micro-batch per rank, and one traced trial at the micro-batch asked about, so that the answer to
"does it fit" is that size's peak, not the largest size's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit._version import versions
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import ShardedEstimate
from batchfit.parallel.trace import trace_rank
from batchfit.search.result import SearchResult
from batchfit.search.runner import probe_workload
from batchfit.search.runner import search_workload
from batchfit.search.trial import Trial
from batchfit.workflows.arguments import check_capacity_spec
from batchfit.workflows.arguments import check_choices
from batchfit.workflows.arguments import check_model_spec
from batchfit.workflows.arguments import check_progress
from batchfit.workflows.arguments import check_size
from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.ranks import NOT_TRACED
from batchfit.workflows.ranks import capacity_of
from batchfit.workflows.routing import DEFAULT_SEQ_LEN


@dataclass(frozen=True)
class ChoiceEstimate:
    """One activation-checkpointing choice: its largest micro-batch per rank and the trace ``at`` the size
    asked about (the largest's own trace when none was asked)."""

    parallelism: Parallelism
    largest: LargestBatch
    at: ShardedEstimate


@dataclass(frozen=True)
class ConfigEstimate:
    """Per rank, for a model from its config: each choice's figures on ``capacity``."""

    workload: str
    capacity: str
    capacity_bytes: int
    label: str
    seq_len: int
    choices: list[ChoiceEstimate]
    batch_size: int | None = None

    def fitting(self) -> list[str]:
        """The checkpointing choices whose trace at the asked micro-batch fits the capacity."""
        return [c.parallelism.activation_checkpointing for c in self.choices if c.at.peak_bytes <= self.capacity_bytes]

    def to_dict(self) -> dict[str, Any]:
        """The JSON: the first choice's figures at the top (``peak_bytes``, ``breakdown``, ``world_size``,
        ``largest_batch_size``, all per rank), every choice under ``choices``."""
        first = self.choices[0]
        at = first.at
        return {
            "peak_bytes": at.peak_bytes,
            "breakdown": dict(at.breakdown),
            "world_size": at.world_size,
            "largest_batch_size": first.largest.batch_size,
            **at.host_part(),
            "batch_size": at.batch_size,
            "seq_len": self.seq_len,
            "workload": {"name": self.workload, "options": {"seq_len": self.seq_len}},
            "device": {"name": self.capacity, "capacity_bytes": self.capacity_bytes, "per_rank": True},
            "parallelism": at.parallelism.to_dict(),
            "choices": [
                {
                    "activation_checkpointing": choice.parallelism.activation_checkpointing,
                    "largest_batch_size": choice.largest.batch_size,
                    "estimate": choice.at.to_dict(),
                    "search": choice.largest.to_dict(),
                }
                for choice in self.choices
            ],
            "not_traced": list(NOT_TRACED),
            "versions": versions(),
        }


def estimate_config(
    workload: str,
    capacity: str,
    choices: list[Parallelism],
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    progress: Progress = SILENT,
) -> ConfigEstimate:
    """Per rank, for each choice: the largest micro-batch within ``capacity`` and the trace at ``batch_size``
    (else at that largest size).

    >>> found = estimate_config("examples/llama-tiny.json", "8MiB", [Parallelism(world_size=4)], seq_len=64,
    ...                         batch_size=1)
    >>> found.fitting(), found.choices[0].at.batch_size
    (['none'], 1)
    """
    from batchfit.parallel.models import model_config

    check_model_spec(workload)
    check_capacity_spec(capacity)
    choices = check_choices(choices)
    if batch_size is not None:
        check_size("batch_size", batch_size)
    if seq_len is not None:
        check_size("seq_len", seq_len)
    check_progress(progress)
    model_config(workload)  # a file that is not a model config, or an unknown name, fails here in one line
    seq_len = seq_len or DEFAULT_SEQ_LEN
    capacity_bytes, label = capacity_of(capacity)
    results = []
    for parallelism in choices:
        with progress.working(f"Tracing one rank, activation checkpointing {parallelism.activation_checkpointing}"):
            largest = largest_batch_size(workload, seq_len, capacity_bytes, parallelism=parallelism)
            at = largest.estimate
            if batch_size is not None and batch_size != largest.batch_size:
                at = trace_rank(workload, batch_size, seq_len, parallelism=parallelism)
        results.append(ChoiceEstimate(parallelism, largest, at))
    return ConfigEstimate(workload, capacity, capacity_bytes, label, seq_len, results, batch_size)


@dataclass(frozen=True)
class RankEstimate:
    """One rank of a workload's own sharded copy, traced: the search for its largest micro-batch, and the
    traced trial ``at`` the micro-batch asked about (``None`` when none was)."""

    search: SearchResult
    at: Trial | None = None


def estimate_own_rank(
    work: Any, device: Any, *, batch_size: int | None = None, progress: Progress = SILENT
) -> RankEstimate:
    """The largest micro-batch per rank of ``work`` (one rank's ``ShardedCopy``) on ``device`` (a
    ``TraceDevice``), and with ``batch_size`` one traced trial at it: whether it fits, and its peak."""
    if batch_size is not None:
        check_size("batch_size", batch_size)
    check_progress(progress)
    with progress.working("Tracing one rank on fake tensors"):
        search = search_workload(work, device=device)
    if batch_size is None:
        return RankEstimate(search)
    if batch_size == search.batch_size:
        return RankEstimate(search, next(t for t in search.trials if t.batch_size == batch_size))
    with progress.working(f"Tracing one rank at micro-batch {batch_size}"):
        return RankEstimate(search, probe_workload(work, batch_size, device=device))
