"""How the Microbatcher cuts a global batch into micro-batches: runs of ``size`` rows, or, with a token budget,
runs of rows that hold at most the budget as the device holds them (rows times the widest row, each row up to
its last attended position, the padding after it cut off).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from batchfit.errors import InputError
from batchfit.step.batching import cut_sequences
from batchfit.step.batching import sequence_widths
from batchfit.step.batching import slice_batch


def default_tokens_per_sample(batch: Any) -> torch.Tensor:
    """Tokens in each sample: the sum of ``attention_mask`` where there is one, else the length
    of the sequence dimension of the first tensor with one."""
    if isinstance(batch, Mapping) and "attention_mask" in batch:
        return batch["attention_mask"].sum(dim=1)
    return widths_of(batch)


def widths_of(batch: Any) -> torch.Tensor:
    """``sequence_widths(batch)``, refused in one line for a batch without sequences."""
    widths = sequence_widths(batch)
    if widths is None:
        raise InputError("max_tokens needs sequences: give tokens_per_sample(batch) -> tokens of each sample")
    return widths


def row_slices(total: int, size: int) -> list[tuple[int, int]]:
    """Row ranges of ``size`` rows each (the last may be shorter).

    >>> row_slices(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def token_slices(widths: list[int], budget_tokens: int) -> list[tuple[int, int]]:
    """Row ranges, in order, each as many rows as fit ``budget_tokens`` counted as rows times the widest row
    (what the padded micro-batch holds); a row wider than the budget is an error.

    >>> token_slices([3, 8, 2, 2, 5], 10)
    [(0, 1), (1, 2), (2, 4), (4, 5)]
    """
    if max(widths) > budget_tokens:
        raise RuntimeError(
            f"a single sample holds {max(widths)} tokens, more than the budget of {budget_tokens}: raise max_tokens "
            "or free memory"
        )
    slices, start, widest = [], 0, 0
    for row, width in enumerate(widths):
        if (row - start + 1) * max(widest, width) > budget_tokens:
            slices.append((start, row))
            start, widest = row, 0
        widest = max(widest, width)
    slices.append((start, len(widths)))
    return slices


def micro_batch(batch: Any, start: int, stop: int, widths: list[int] | None = None) -> Any:
    """Rows ``start:stop``; with ``widths``, cut to the widest of them (the padding after every row's last
    attended position is dropped: nothing attends it, and a token budget counts it)."""
    piece = slice_batch(batch, start, stop)
    return piece if widths is None else cut_sequences(piece, max(widths[start:stop]))
