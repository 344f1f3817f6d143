"""Token budgets for training on sequences of many lengths: the largest padded batch per bucket and the
largest packed micro-batch in tokens, each found and confirmed by real trials.

Every bucket is searched at its longest sequence by the library's one search (``search_workload``): its
answer fitted and one more did not, both tried. The longest and the shortest bucket are searched first, as
any search runs; from their trials ``TokenMemoryFit`` fits fixed + per-token + per-squared-length bytes,
and every other bucket's search starts from the size that fit predicts, so a good prediction costs two
trials (the size, and one more). The fit is refined by every bucket searched. A search per bucket that
doubles and bisects (NeMo's OOMptimizer) spends 5-8 trials per bucket or more.

The packed budget is searched in tokens: a packed micro-batch's rows are its tokens (``PackedRows``). It is
searched twice, on sequences of the longest bucket's length laid end to end (the most attention per token)
and of the shortest's (the most sequences per token, each with its own small tensors), the smaller answer
binding; mixes of lengths between the two cost no more per token (see ``PackedBudget``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import torch

from batchfit.bounds import check_flag
from batchfit.devices.resolve import resolve_device
from batchfit.errors import InputError
from batchfit.errors import ModelDoesNotFitError
from batchfit.errors import NoBatchFitsError
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.runner import usable_bytes
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import make_strategy
from batchfit.search.trial import Trial
from batchfit.step.workload import Workload
from batchfit.tokens.lengths import bucket_lengths
from batchfit.tokens.memory_fit import LengthLine
from batchfit.tokens.memory_fit import TokenMemoryFit
from batchfit.tokens.result import MODES
from batchfit.tokens.result import BucketBudget
from batchfit.tokens.result import ModeBudget
from batchfit.tokens.result import PackedBudget
from batchfit.tokens.result import TokenBudget
from batchfit.tokens.samples import PackedRows
from batchfit.tokens.samples import at_length
from batchfit.tokens.samples import check_host_room
from batchfit.tokens.samples import packed_rows
from batchfit.tokens.samples import packing_refusal
from batchfit.tokens.stacks import stack_lines

Said = Callable[[str], None]


def search_order(lengths: Sequence[int]) -> list[int]:
    """The longest bucket, the shortest, then the rest from long to short (each between two measured).

    >>> search_order([128, 256, 512, 1024])
    [1024, 128, 512, 256]
    """
    ordered = sorted(lengths)
    return [ordered[-1], *ordered[:1][: len(ordered) - 1], *reversed(ordered[1:-1])]


def token_budget_of_workload(
    workload: Workload,
    lengths: Sequence[int],
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    packed: bool | None = None,
    forward: bool = False,
    accumulating: bool = True,
    said: Said | None = None,
) -> TokenBudget:
    """``find_token_budget`` for a ``Workload`` whose sample holds sequences along dimension 1.

    ``lengths``: each bucket's longest sequence. ``packed``: ``True`` measures the packed budget (refused in
    one line where the sample cannot be packed), ``False`` skips it, ``None`` measures it where the sample can
    be packed. ``forward`` also measures forward-only budgets (scoring, reference log-probs), larger than
    training's. ``accumulating`` (the default) measures training as a later micro-batch of an accumulation
    window, the window's gradients held through forward and backward: every stack that batches by tokens
    accumulates over its micro-batches, and a budget measured without the gradients runs out of memory from
    the second micro-batch on; ``False`` measures steps that each make a whole optimizer step.
    A bucket where not even one sequence fits goes to each mode's ``too_long`` with its trials, and the rest are
    measured; only when no bucket fits, ``NoBatchFitsError`` says so. ``said(line)`` hears each answer as it is
    found.
    """
    start = time.perf_counter()
    check_flag("packed", packed, optional=True)
    check_flag("forward", forward)
    check_flag("accumulating", accumulating)
    lengths = bucket_lengths(lengths)
    check_host_room(workload.sample_batch, lengths[-1])  # before any trial, not after the short buckets
    base = SearchSettings.of(settings)
    dev = resolve_device(device, workload.model)
    capacity, limit = usable_bytes(dev, base.margin)
    refusal = packing_refusal(workload.model, workload.sample_batch)
    if packed and refusal is not None:
        raise InputError(f"cannot measure a packed budget: {refusal}; drop packed=True (or --packed)")
    quiet = said or (lambda line: None)
    training = (
        dataclasses.replace(workload, accumulating=accumulating) if workload.accumulating != accumulating else workload
    )
    modes = [
        _mode_budget(training, mode, lengths, base, dev, limit, packed, refusal, quiet) for mode in _modes(forward)
    ]
    budget = TokenBudget(
        workload.name,
        dev.name,
        capacity,
        limit,
        modes[0],
        modes[1] if forward else None,
        time.perf_counter() - start,
        accumulating=accumulating,
    )
    budget.lines = stack_lines(budget)
    return budget


def _modes(forward: bool) -> list[str]:
    return ["train", "eval"] if forward else ["train"]


def _mode_budget(
    workload: Workload,
    mode: str,
    lengths: list[int],
    settings: SearchSettings,
    device: Any,
    limit: int | None,
    packed: bool | None,
    refusal: str | None,
    said: Said,
) -> ModeBudget:
    work = workload if workload.mode == mode else dataclasses.replace(workload, mode=mode, accumulating=False)
    buckets: dict[int, BucketBudget] = {}
    too_long: dict[int, list[Trial]] = {}
    lines: list[LengthLine] = []
    fit: TokenMemoryFit | None = None
    for seq_len in search_order(lengths):
        guess = fit.largest_batch_size(seq_len, limit) if fit is not None and len(fit.lengths) > 1 and limit else None
        try:
            bucket = _search_bucket(work, seq_len, settings, device, guess)
        except ModelDoesNotFitError:
            raise  # the model's own state fills the memory: no length fits
        except NoBatchFitsError as error:  # a bucket too long for even one sequence: the shorter ones still count
            too_long[seq_len] = list(error.trials)
            said(f"{mode}: not even one sequence of {seq_len} tokens fits ({len(error.trials)} trials)")
            continue
        buckets[seq_len] = bucket
        said(f"{mode}: {bucket.batch_size} sequences of {seq_len} tokens fit ({len(bucket.search.trials)} trials)")
        line = LengthLine.through(seq_len, bucket.search.trials, limit) if limit else None
        if line is not None:
            lines = [*(known for known in lines if known.seq_len != seq_len), line]
            fit = TokenMemoryFit.of(lines)
    fitting = [seq_len for seq_len in lengths if seq_len in buckets]
    if not fitting:
        shortest = min(too_long)
        raise NoBatchFitsError(
            f"not even one sequence of {shortest} tokens fits in {MODES[mode]}: use AMP, gradient checkpointing, "
            "shorter buckets, a smaller model or more memory",
            too_long[shortest],
        )
    packed_budget = None
    if packed or (packed is None and refusal is None):
        packed_budget = _search_packed(work, fitting, settings, device)
        said(f"{mode}: packed, {packed_budget.tokens} tokens fit ({packed_budget.trials} trials)")
    elif packed is None:
        packed_budget = PackedBudget(skipped=refusal)
    return ModeBudget(
        mode, [buckets[seq_len] for seq_len in fitting], packed_budget, fit, dict(sorted(too_long.items()))
    )


def _search_bucket(
    work: Workload, seq_len: int, settings: SearchSettings, device: Any, guess: int | None
) -> BucketBudget:
    """The largest padded batch at ``seq_len``; the search starts at ``guess`` where there is one."""
    at = dataclasses.replace(work, sample_batch=at_length(work.sample_batch, seq_len))
    seeded = settings if guess is None else settings.replace(strategy=make_strategy("auto", guess=guess))
    return BucketBudget(seq_len, search_workload(at, seeded, device=device), guess)


def _search_packed(work: Workload, lengths: list[int], settings: SearchSettings, device: Any) -> PackedBudget:
    """The largest packed micro-batch in tokens: sequences of the longest bucket's length laid end to end, then
    of the shortest's (the search starting at the first answer), the smaller answer binding."""
    budget = PackedBudget()
    for seq_len in dict.fromkeys((lengths[-1], lengths[0])):
        packed = dataclasses.replace(
            work, model=PackedRows(work.model), sample_batch=packed_rows(work.sample_batch, seq_len), name=work.name
        )
        first = budget.search
        seeded = settings if first is None else settings.replace(strategy=make_strategy("auto", guess=first.batch_size))
        budget.searches[seq_len] = search_workload(packed, seeded, device=device)
    return budget


def find_token_budget(
    model: torch.nn.Module,
    sample_batch: Any,
    *,
    lengths: Sequence[int] | None = None,
    max_seq_len: int | None = None,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    amp_dtype: torch.dtype | str | None = None,
    device: DeviceSpec = None,
    packed: bool | None = None,
    forward: bool = False,
    accumulating: bool = True,
    step_fn: Callable | None = None,
    keep_output: bool = True,
    settings: SearchSettings | None = None,
) -> TokenBudget:
    """The largest padded batch per sequence-length bucket and the largest packed micro-batch in tokens, for
    training (and, with ``forward``, for forward-only passes), each an answer a real trial fitted with one
    more failing.

    ``sample_batch`` holds sequences along dimension 1 (token ids, labels, a mask), at any length: it is cut
    or padded to each bucket's longest. Buckets are ``lengths`` (each bucket's longest sequence) or made from
    ``max_seq_len`` by halving (6 buckets). A packed batch is a mapping sample for a model that takes
    ``position_ids`` (as ``DataCollatorWithFlattening`` feeds a Hugging Face model). Training is measured as a
    later micro-batch of an accumulation window (``accumulating``, see ``token_budget_of_workload``). ``settings`` (a
    ``SearchSettings``) says how each search runs: ``margin``, ``steps``, ``max_trials`` ...

    >>> import batchfit as bf
    >>> from batchfit.step.builtin_workloads import gpt_tiny
    >>> work = gpt_tiny(seq_len=64)
    >>> budget = bf.find_token_budget(work.model, work.sample_batch, lengths=[32, 64], loss_fn=work.loss_fn,
    ...                               optimizer=work.optimizer, device="sim:96MiB")
    >>> [(bucket.seq_len, bucket.batch_size) for bucket in budget.training.buckets]
    [(32, 112), (64, 56)]
    """
    workload = Workload(model, sample_batch, loss_fn, optimizer, amp_dtype, step_fn=step_fn, keep_output=keep_output)
    return token_budget_of_workload(
        workload,
        bucket_lengths(lengths, max_seq_len),
        settings,
        device=device,
        packed=packed,
        forward=forward,
        accumulating=accumulating,
    )
