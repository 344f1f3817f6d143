"""Token budgets per rank under FSDP2, for a model built from its config (``batchfit tokens CONFIG --gpus N``).

Each bucket's largest micro-batch per rank is traced at its longest sequence (torch's own ``fully_shard`` over
a fake process group, fake tensors: ``parallel.fit.largest_batch_size``), and with ``verify`` proved by one
rank's real trials, as ``plan --verify`` proves a plan: the traced answer and the size above are run for real
on one device holding one rank's shards (the search starting at the traced answer, so an exact trace costs two
trials), and a traced answer that does not hold gives way to what the real trials find.

Training is measured as a later micro-batch of an accumulation window (``accumulating``, the default), as every
stack that takes a token budget accumulates over its micro-batches: FSDP2 keeps the window's reduced gradient
shards through it, so each bucket is traced again within the capacity less their bytes, and verified by real
trials of a later micro-batch.

A model from its config trains on padded token ids: its budget is padded (rows x the bucket's longest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.devices.units import format_bytes
from batchfit.errors import NoBatchFitsError
from batchfit.parallel.fit import LargestBatch
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.models import model_config
from batchfit.parallel.one_rank import RankWorkload
from batchfit.parallel.settings import Parallelism
from batchfit.search.result import SearchResult
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import make_strategy
from batchfit.tokens.lengths import bucket_lengths
from batchfit.tokens.stacks import padded_lines
from batchfit.workflows.arguments import check_capacity_spec
from batchfit.workflows.arguments import check_flag
from batchfit.workflows.arguments import check_lengths
from batchfit.workflows.arguments import check_model_spec
from batchfit.workflows.arguments import check_parallelism
from batchfit.workflows.arguments import check_progress
from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.ranks import capacity_of
from batchfit.workflows.ranks import held_gradient_bytes
from batchfit.workflows.ranks import traced_with_gradients_held
from batchfit.workflows.verification import verification_device


@dataclass
class RankBucket:
    """One bucket, one rank: the traced answer (``traced``) and, when verified, one rank's real search from it.
    Measured as a later micro-batch of an accumulation window, ``whole_step`` is the trace of a whole step it
    started from and ``held_gradient_bytes`` the gradient shards the window holds (``None`` and 0 otherwise)."""

    seq_len: int
    traced: LargestBatch
    verified: SearchResult | None = None
    whole_step: LargestBatch | None = None
    held_gradient_bytes: int = 0

    @property
    def traces(self) -> int:
        """Sizes traced for this bucket: the whole step's search and the held one (which reuses its traces)."""
        whole_step = self.whole_step
        separate = whole_step is not None and whole_step is not self.traced
        return self.traced.traces + (whole_step.traces if separate else 0)

    @property
    def batch_size(self) -> int:
        """The real trials' answer where they ran, else the trace's."""
        return self.verified.batch_size if self.verified is not None else self.traced.batch_size

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        verified = self.verified
        return {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "tokens": self.tokens,
            "traced_batch_size": self.traced.batch_size,
            "whole_step_batch_size": None if self.whole_step is None else self.whole_step.batch_size,
            "held_gradient_bytes": self.held_gradient_bytes,
            "traces": self.traces,
            "verified": None
            if verified is None
            else {
                "batch_size": verified.batch_size,
                "exact": verified.exact,
                "device": verified.device,
                "trials": [trial.to_dict() for trial in verified.trials],
            },
        }


@dataclass
class ShardedTokenBudget:
    """Every bucket's micro-batch per rank of ``parallelism`` within ``capacity`` (a preset or a size)."""

    workload: str
    capacity: str
    capacity_bytes: int
    parallelism: Parallelism
    buckets: list[RankBucket]
    accumulating: bool = True

    @property
    def traces(self) -> int:
        return sum(bucket.traces for bucket in self.buckets)

    @property
    def trials(self) -> int:
        return sum(len(bucket.verified.trials) for bucket in self.buckets if bucket.verified is not None)

    @property
    def lines(self) -> dict[str, list[str]]:
        """The padded stacks' lines, per rank (see ``batchfit.tokens.stacks``)."""
        fitting = [bucket for bucket in self.buckets if bucket.batch_size > 0]
        if not fitting:
            return {}
        tokens = min(bucket.tokens for bucket in fitting)
        sizes = [bucket.batch_size for bucket in fitting]
        return padded_lines([bucket.seq_len for bucket in fitting], sizes, tokens, tokens, sizes[-1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "capacity": self.capacity,
            "capacity_bytes": self.capacity_bytes,
            "parallelism": self.parallelism.to_dict(),
            "accumulating": self.accumulating,
            "lengths": [bucket.seq_len for bucket in self.buckets],
            "buckets": [bucket.to_dict() for bucket in self.buckets],
            "traces": self.traces,
            "trials": self.trials,
            "lines": self.lines,
        }


def sharded_token_budget(
    workload: str,
    lengths: Sequence[int],
    capacity: str,
    parallelism: Parallelism,
    *,
    verify: bool = False,
    accumulating: bool = True,
    progress: Progress = SILENT,
) -> ShardedTokenBudget:
    """Per bucket (each bucket's longest sequence in ``lengths``), the largest micro-batch per rank of
    ``parallelism`` for ``workload`` (an LLM preset or a config.json) within ``capacity``, traced; with
    ``verify``, proved by one rank's real trials on a simulated device of that capacity. ``accumulating``
    (the default): as a later micro-batch of an accumulation window, the window's gradient shards held;
    ``False``: each micro-batch a whole optimizer step.

    >>> found = sharded_token_budget("examples/llama-tiny.json", [32], "8MiB", Parallelism(world_size=4))
    >>> [(bucket.seq_len, bucket.batch_size > 0, bucket.verified) for bucket in found.buckets]
    [(32, True, None)]
    """
    check_model_spec(workload)
    check_capacity_spec(capacity)
    check_parallelism(parallelism)
    check_flag("verify", verify)
    check_flag("accumulating", accumulating)
    check_progress(progress)
    model_config(workload)  # a file that is not a model config, or an unknown name, fails here in one line
    capacity_bytes, label = capacity_of(capacity)
    buckets = []
    for seq_len in bucket_lengths(check_lengths(lengths)):
        with progress.working(f"Tracing one rank of {parallelism.world_size} at {seq_len} tokens"):
            bucket = _traced(workload, seq_len, capacity_bytes, parallelism, accumulating)
        if verify and bucket.traced.batch_size > 0:
            with progress.working(f"One rank's real trials at {seq_len} tokens"):
                bucket.verified = _verified(workload, seq_len, parallelism, capacity_bytes, bucket, accumulating)
        progress.said(_found(bucket, label))
        buckets.append(bucket)
    if not any(bucket.batch_size for bucket in buckets):  # as the one-device budget: an answer of none is an error
        raise NoBatchFitsError(
            f"not even one sequence of {buckets[0].seq_len} tokens, the shortest bucket, fits one rank of "
            f"{parallelism.world_size} on {label}: give shorter buckets, more ranks, activation checkpointing "
            "or more memory",
            [],
        )
    return ShardedTokenBudget(workload, capacity, capacity_bytes, parallelism, buckets, accumulating)


def _traced(
    workload: str, seq_len: int, capacity_bytes: int, parallelism: Parallelism, accumulating: bool
) -> RankBucket:
    """One bucket's trace: a whole step's, then (``accumulating``) a later micro-batch's, its gradients held."""
    whole_step = largest_batch_size(workload, seq_len, capacity_bytes, parallelism=parallelism)
    if not accumulating:
        return RankBucket(seq_len, whole_step)
    held = traced_with_gradients_held(workload, seq_len, capacity_bytes, parallelism, whole_step)
    return RankBucket(seq_len, held, whole_step=whole_step, held_gradient_bytes=held_gradient_bytes(whole_step))


def _verified(
    workload: str, seq_len: int, parallelism: Parallelism, capacity_bytes: int, bucket: RankBucket, accumulating: bool
) -> SearchResult:
    """One rank's real search at ``seq_len`` (of a later micro-batch where ``accumulating``), starting at the traced
    answer."""
    work = RankWorkload(workload, seq_len, parallelism, accumulating=accumulating)
    settings = SearchSettings(strategy=make_strategy("auto", guess=bucket.traced.batch_size))
    return search_workload(work, settings, device=verification_device("auto", capacity_bytes))


def _found(bucket: RankBucket, label: str) -> str:
    held = ""
    if bucket.held_gradient_bytes:
        held = f" with the window's gradient shards held ({format_bytes(bucket.held_gradient_bytes)})"
    said = (
        f"{bucket.seq_len} tokens: {bucket.traced.batch_size} sequences per rank traced on {label}{held} "
        f"({bucket.traces} traces)"
    )
    if bucket.verified is not None:
        verdict = "held" if bucket.verified.batch_size == bucket.traced.batch_size else "gave way"
        said += (
            f"; one rank's real trials: {bucket.verified.batch_size} fits, {bucket.verified.batch_size + 1} does not "
            f"({len(bucket.verified.trials)} trials, the trace {verdict})"
        )
    return said + "."
