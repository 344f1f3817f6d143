"""The largest micro-batch per rank under a capacity, from a few traces of one rank.

Activations and backward's temporaries grow linearly in the micro-batch while everything else
(sharded state, gathered parameters, buffers) stays, so the line through the traces at 1 and 2
predicts the edge; the answer is then confirmed by tracing it and the size above it. Where a
trace disagrees with the line (allocator rounding, a peak that moves to another phase), the
search keeps the traced sizes that fit and do not, and interpolates and halves between them, so
the answer is always a traced size that fits next to a traced size that does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.devices.trace import trace_capacity_bytes
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import ShardedEstimate
from batchfit.parallel.trace import trace_rank


@dataclass(frozen=True)
class LargestBatch:
    """The largest micro-batch per rank whose traced peak fits ``capacity_bytes``: ``batch_size``
    (0 when even 1 does not fit), the trace at it (``estimate``; at 1 when none fits) and the
    trace one above it (``above``, over the capacity; ``None`` when ``max_batch_size`` fits)."""

    batch_size: int
    capacity_bytes: int
    estimate: ShardedEstimate
    above: ShardedEstimate | None
    traces: int

    def to_dict(self) -> dict[str, Any]:
        """``largest_batch_size``, the capacity, and both traces' dictionaries."""
        return {
            "largest_batch_size": self.batch_size,
            "capacity_bytes": self.capacity_bytes,
            "estimate": self.estimate.to_dict(),
            "above": None if self.above is None else self.above.to_dict(),
            "traces": self.traces,
        }


def _line_guess(low: tuple[int, int], high: tuple[int, int], capacity_bytes: int) -> int | None:
    """The batch size where the line through two ``(batch, peak)`` points reaches the capacity."""
    (b1, p1), (b2, p2) = low, high
    if p2 <= p1:
        return None
    return b1 + (capacity_bytes - p1) * (b2 - b1) // (p2 - p1)


def _next_size(history: list[tuple[int, int]], capacity_bytes: int, max_batch_size: int) -> int | None:
    """The next batch size to trace after the ``(batch, peak)`` traces of ``history`` (in the order
    traced), or ``None`` once a fitting size sits next to a failing one (or the maximum fits).
    Unbracketed: the line from the trace at 1 through the largest fitting one (doubling where it
    is flat). Bracketed: the line between the bracket's ends, where it predicts the edge at the
    fitting end, the size above it; after two traces on one side (the line creeping up on a
    curved peak), the bracket's middle."""
    peaks = dict(history)
    fitting = sorted(b for b, peak in peaks.items() if peak <= capacity_bytes)
    failing = sorted(b for b, peak in peaks.items() if peak > capacity_bytes)
    lo, hi = fitting[-1], (failing[0] if failing else None)
    if (hi is not None and hi == lo + 1) or (hi is None and lo >= max_batch_size):
        return None
    if hi is None:
        guess = _line_guess((fitting[0], peaks[fitting[0]]), (lo, peaks[lo]), capacity_bytes)
        return min(max(lo * 2 if guess is None else guess, lo + 1), max_batch_size)
    guess = _line_guess((lo, peaks[lo]), (hi, peaks[hi]), capacity_bytes)
    if guess is None or guess <= lo:
        return lo + 1
    sides = [peak <= capacity_bytes for _, peak in history[-2:]]
    if len(history) > 3 and sides[0] == sides[1]:
        return (lo + hi) // 2
    return min(guess, hi - 1)


def _history(traced: dict[int, ShardedEstimate]) -> list[tuple[int, int]]:
    return [(batch_size, estimate.peak_bytes) for batch_size, estimate in traced.items()]


def largest_batch_size(
    model: ModelSpec,
    seq_len: int,
    capacity: int | str,
    *,
    parallelism: Parallelism | None = None,
    max_batch_size: int = 1 << 16,
    **trace_options: Any,
) -> LargestBatch:
    """The largest micro-batch of ``seq_len`` tokens one rank trains within ``capacity`` (bytes,
    ``"80GiB"`` or a GPU preset such as ``"h100-80gb"``: its usable memory), from ``trace_rank``
    traces (``trace_options`` are its keywords: ``dtype``, ``optimizer``, ``steps``, ``fake``).
    Each trace builds and shards the model anew (seconds for an 8B model); a line-guided search
    usually needs four (1, 2, the answer and the size above it)."""
    capacity_bytes = trace_capacity_bytes(capacity)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InputError(f"max_batch_size must be an integer of at least 1, got {max_batch_size!r}")
    traced: dict[int, ShardedEstimate] = {}

    def trace(batch_size: int) -> int:
        traced[batch_size] = trace_rank(model, batch_size, seq_len, parallelism=parallelism, **trace_options)
        return traced[batch_size].peak_bytes

    if trace(1) > capacity_bytes:
        return LargestBatch(0, capacity_bytes, traced[1], None, 1)
    if max_batch_size > 1:
        trace(2)
    while (size := _next_size(_history(traced), capacity_bytes, max_batch_size)) is not None:
        trace(size)
    best = max(b for b, e in traced.items() if e.peak_bytes <= capacity_bytes)
    return LargestBatch(best, capacity_bytes, traced[best], traced.get(best + 1), len(traced))


def describe(found: LargestBatch) -> str:
    """One sentence naming the answer and the capacity.

    >>> from batchfit.parallel.trace import ShardedEstimate
    >>> at = ShardedEstimate(2**30, {"activations": 2**30}, 8, 3, 4096, "backward", Parallelism(world_size=8))
    >>> describe(LargestBatch(3, 2**31, at, None, 3))
    'Up to micro-batch 3 x 4096 tokens per rank fits in 2.0 GiB over 8 ranks (1.0 GiB at 3).'
    """
    at = found.estimate
    if found.batch_size == 0:
        return f"Not even micro-batch 1 x {at.seq_len} tokens fits in {format_bytes(found.capacity_bytes)} per rank."
    return (
        f"Up to micro-batch {found.batch_size} x {at.seq_len} tokens per rank fits in "
        f"{format_bytes(found.capacity_bytes)} over {at.world_size} ranks ({format_bytes(at.peak_bytes)} at {found.batch_size})."
    )
