"""The token budget that holds for a whole run of variable-length data: micro-batches of the lengths the data has,
in random order, with evaluation passes between, through the caching allocator model.

A run batched by tokens fills each micro-batch from one bucket up to the budget: ``T // L`` sequences padded to
the bucket's longest length ``L`` (the worst a bucket holds: every row its longest sequence). Each step draws a
length from the data (a seed makes the order), its bucket names the micro-batch's shape, and the run is those
shapes' logged steps replayed in that order (``batchfit.devices.allocator_soak``). The answer is the largest
budget whose run held every step, the one above it tried and failed; the shape its run fell on is the composition
that binds.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.devices.allocator_soak import SoakPlan
from batchfit.errors import InputError
from batchfit.search.runner import usable_bytes
from batchfit.search.soak import Soaker
from batchfit.search.soak import SoakSettings
from batchfit.search.soak import check_soak_device
from batchfit.search.soak import soaked_budget
from batchfit.search.soak_result import SoakedBudget
from batchfit.tokens.length_data import LengthSample
from batchfit.tokens.result import TokenBudget
from batchfit.tokens.samples import at_length

PADDED = "padded"


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The shortest bucket that holds ``length`` (a longer length is cut to the longest bucket).

    >>> bucket_of(300, [256, 512, 1024]), bucket_of(5000, [256, 512, 1024])
    (512, 1024)
    """
    index = bisect.bisect_left(buckets, length)
    return buckets[min(index, len(buckets) - 1)]


def fresh_tokens(rows_by_length: dict[int, int]) -> int:
    """The largest budget ``T``, a multiple of some bucket's length, whose micro-batch in every bucket (``T // L``
    sequences of ``L``) fitted from an emptied cache: each bucket's answer ``rows_by_length[L]``.

    >>> fresh_tokens({256: 40, 1024: 9})   # 39 x 256: 10 x 1024 did not fit
    9984
    """
    limit = min((rows + 1) * length for length, rows in rows_by_length.items()) - 1
    return max(limit // length * length for length in rows_by_length)


def candidate_tokens(buckets: Sequence[int], fresh: int) -> list[int]:
    """Every budget up to ``fresh`` where some bucket's micro-batch gains a sequence, from one sequence of the
    longest bucket: between two of them every bucket's shape is the same.

    >>> candidate_tokens([2, 3], 9)
    [3, 4, 6, 8, 9]
    """
    longest = max(buckets)
    return sorted({rows * length for length in buckets for rows in range(1, fresh // length + 1)} - set(range(longest)))


def token_plan(tokens: int, buckets: Sequence[int], sample: LengthSample, settings: SoakSettings) -> SoakPlan:
    """The run of a budget of ``tokens``: each training step's micro-batch ``("padded", tokens // L, L)`` for the
    bucket ``L`` of a length drawn with ``settings.seed``; each evaluation pass the same ``eval_steps`` micro-batches
    (drawn with ``seed + 1``: one validation set).

    >>> run = token_plan(1024, [128, 512], LengthSample.of([100, 300]), SoakSettings(steps=3, eval_every_steps=2))
    >>> run.train, len(run.eval_shapes)
    ((('padded', 2, 512), ('padded', 8, 128), ('padded', 8, 128)), 4)
    """

    def micro_batch(length: int) -> tuple[str, int, int]:
        bucket = bucket_of(int(length), buckets)
        return (PADDED, tokens // bucket, bucket)

    train = tuple(micro_batch(length) for length in sample.draw(settings.steps, settings.seed))
    evals = ()
    if settings.eval_every_steps:
        evals = tuple(micro_batch(length) for length in sample.draw(settings.eval_steps, settings.seed + 1))
    return SoakPlan(train, settings.eval_every_steps, evals)


@dataclass
class TokenSoak:
    """A token budget's soak: ``soaked`` (in tokens per micro-batch, its runs and expandable segments' answer),
    the ``buckets`` the steps were drawn into, the bucket that binds from an emptied cache
    (``fresh_binding_seq_len``), and how many drawn lengths were longer than the longest bucket (``cut_lengths``)."""

    soaked: SoakedBudget
    buckets: list[int]
    fresh_binding_seq_len: int
    cut_lengths: int = 0

    def binding(self) -> str:
        """Which composition binds the run, in words."""
        failed = self.soaked.failed
        fresh = f"from an emptied cache, the bucket of {self.fresh_binding_seq_len} tokens binds"
        if failed is None or failed.failed_shape is None:
            return fresh
        _, rows, length = failed.failed_shape
        where = "its evaluation pass" if failed.failed_in_eval else "its training step"
        return (
            f"{fresh}; over the run, {self.soaked.failed_budget} tokens ran out of memory at step {failed.failed_step}"
            f" in {where}, on {rows} sequences of {length} tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.soaked.to_dict(),
            "buckets": self.buckets,
            "fresh_binding_seq_len": self.fresh_binding_seq_len,
            "cut_lengths": self.cut_lengths,
            "binding": self.binding(),
        }


def soak_token_budget(
    workload: Any,
    budget: TokenBudget,
    lengths: LengthSample | Sequence[int] | dict[int, int] | str,
    settings: SoakSettings | None = None,
    *,
    device: Any,
    margin: int | float | str = 0,
) -> TokenSoak:
    """The largest tokens per micro-batch, at most the fresh-cache one that ``budget`` (``token_budget_of_workload``'s
    answer on ``device``) gives every bucket, that holds for ``settings.steps`` training steps of ``lengths`` (drawn
    with ``settings.seed``; a histogram, a list, or a file) in the caching allocator model of ``device``, with an
    evaluation pass of ``eval_steps`` micro-batches every ``eval_every_steps``; beside it, the same with expandable
    segments. (The example runs searches for some seconds: tests/search/test_soak.py runs one like it.)

    >>> import batchfit as bf
    >>> from batchfit.step.builtin_workloads import gpt_tiny
    >>> from batchfit.tokens.budget import token_budget_of_workload
    >>> work, device = gpt_tiny(seq_len=16, layers=1), bf.SimulatedDevice("6MiB", allocator="cuda")
    >>> budget = token_budget_of_workload(work, [8, 16], device=device, packed=False, accumulating=False)  # doctest: +SKIP
    >>> run = soak_token_budget(work, budget, {5: 9, 14: 1}, SoakSettings(steps=20), device=device)  # doctest: +SKIP
    >>> run.soaked.budget <= run.soaked.fresh, run.buckets  # doctest: +SKIP
    (True, [8, 16])
    """
    settings = settings or SoakSettings()
    sample = lengths if isinstance(lengths, LengthSample) else LengthSample.of(lengths)
    check_soak_device(device)
    rows_by_length = {bucket.seq_len: bucket.batch_size for bucket in budget.training.buckets}
    if not rows_by_length:
        raise InputError("no bucket fits even one sequence: nothing to soak")
    buckets = sorted(rows_by_length)
    _, limit = usable_bytes(device, margin)
    training = dataclasses.replace(workload, accumulating=budget.accumulating, mode="train")
    evaluating = dataclasses.replace(workload, accumulating=False, mode="eval")

    def plan(tokens: int) -> SoakPlan:
        return token_plan(tokens, buckets, sample, settings)

    def shape(key: Hashable, mode: str) -> tuple[Any, int]:
        _, rows, length = key
        work = training if mode == "train" else evaluating
        return dataclasses.replace(work, sample_batch=at_length(work.sample_batch, length)), rows

    fresh = fresh_tokens(rows_by_length)
    soaker = Soaker(device, limit, plan, shape)
    soaked = soaked_budget(soaker, candidate_tokens(buckets, fresh), "tokens per micro-batch")
    binding = min(buckets, key=lambda length: (rows_by_length[length] + 1) * length)
    cut = sum(1 for length in sample.draw(settings.steps, settings.seed) if length > buckets[-1])
    return TokenSoak(soaked, buckets, binding, cut)
