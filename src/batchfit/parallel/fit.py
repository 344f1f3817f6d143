"""The largest micro-batch per rank under a capacity, from a few traces of one rank.

Activations and backward's temporaries grow linearly in the micro-batch while everything else
(sharded state, gathered parameters, buffers) stays, so each phase's peak (forward, backward,
optimizer) is a line in the micro-batch and the step's peak is the highest of them: the lines
through the traces at 1 and 2 predict the edge, also when the peak moves from one phase to
another between them and the edge (large models with activation checkpointing peak in the
optimizer step at small batches). The answer is then confirmed by tracing it and the size above
it. Where a trace disagrees with the lines (allocator rounding, a curved peak), the search keeps
the traced sizes that fit and do not, and interpolates and halves between them, so the answer is
always a traced size that fits next to a traced size that does not.

All sizes are traced on one ``RankSession``: the model is built and sharded once, and every size
after the first costs one steady training step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

from batchfit.devices.trace import trace_capacity_bytes
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import RankSession
from batchfit.parallel.trace import ShardedEstimate


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
    steps: int = 0
    """Training steps traced in all (the first size's warm-up steps, then one per later size)."""

    def to_dict(self) -> dict[str, Any]:
        """``largest_batch_size``, the capacity, and both traces' dictionaries."""
        return {
            "largest_batch_size": self.batch_size,
            "capacity_bytes": self.capacity_bytes,
            "estimate": self.estimate.to_dict(),
            "above": None if self.above is None else self.above.to_dict(),
            "traces": self.traces,
            "steps": self.steps,
        }


Points = dict[int, dict[str, int]]  # batch size -> peak bytes by phase (or the step's peak alone)


def _line_guess(low: tuple[int, int], high: tuple[int, int], capacity_bytes: int) -> int | None:
    """The batch size where the line through two ``(batch, peak)`` points reaches the capacity."""
    (b1, p1), (b2, p2) = low, high
    if p2 <= p1:
        return None
    return b1 + (capacity_bytes - p1) * (b2 - b1) // (p2 - p1)


def _lines_guess(points: Points, low: int, high: int, capacity_bytes: int) -> int | None:
    """Where the first of the phases' lines through the traces at ``low`` and ``high`` reaches the
    capacity (the step's peak is the highest phase's): ``None`` when no line rises."""
    guesses = [
        _line_guess((low, points[low][phase]), (high, points[high][phase]), capacity_bytes)
        for phase in points[low].keys() & points[high].keys()
    ]
    rising = [guess for guess in guesses if guess is not None]
    return min(rising) if rising else None


def _next_size(
    history: list[tuple[int, int]], capacity_bytes: int, max_batch_size: int, points: Points | None = None
) -> int | None:
    """The next batch size to trace after the ``(batch, peak)`` traces of ``history`` (in the order
    traced), or ``None`` once a fitting size sits next to a failing one (or the maximum fits).
    ``points`` are the traces' peaks by phase (the step's peak alone where absent): each phase's
    peak is a line in the batch size, so the lines through two traces predict where the first
    of them reaches the capacity. Unbracketed: the lines from the trace at 1 through the largest
    fitting one (doubling where all are flat). Bracketed: the lines between the bracket's ends,
    where they predict the edge at the fitting end, the size above it; after two traces on one
    side (lines creeping up on a curved peak), the bracket's middle."""
    peaks = dict(history)
    points = points or {batch: {"step": peak} for batch, peak in history}
    fitting = sorted(b for b, peak in peaks.items() if peak <= capacity_bytes)
    failing = sorted(b for b, peak in peaks.items() if peak > capacity_bytes)
    lo, hi = fitting[-1], (failing[0] if failing else None)
    if (hi is not None and hi == lo + 1) or (hi is None and lo >= max_batch_size):
        return None
    if hi is None:
        guess = _lines_guess(points, fitting[0], lo, capacity_bytes) if lo > fitting[0] else None
        return min(max(lo * 2 if guess is None else guess, lo + 1), max_batch_size)
    guess = _lines_guess(points, lo, hi, capacity_bytes)
    if guess is None or guess <= lo:
        return lo + 1
    sides = [peak <= capacity_bytes for _, peak in history[-2:]]
    if len(history) > 3 and sides[0] == sides[1]:
        return (lo + hi) // 2
    return min(guess, hi - 1)


def _points(traced: dict[int, ShardedEstimate]) -> Points:
    """Each trace's peaks by phase (the step's peak is the highest of them), or the step's peak
    alone where a trace has none."""
    return {batch: dict(e.phase_peaks_bytes) or {"step": e.peak_bytes} for batch, e in traced.items()}


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
    The model is built and sharded once (a ``RankSession``): the first size runs ``steps``
    steps, every later one a single steady step with the same peak as its own ``trace_rank``.
    A search led by the phases' lines usually traces four sizes (1, 2, the answer and the size
    above it)."""
    capacity_bytes = trace_capacity_bytes(capacity)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InputError(f"max_batch_size must be an integer of at least 1, got {max_batch_size!r}")
    with RankSession(model, seq_len, parallelism=parallelism, **trace_options) as session:
        found = _search(session.trace, capacity_bytes, max_batch_size)
    return replace(found, steps=session.steps_run)


def _search(trace: Callable[[int], ShardedEstimate], capacity_bytes: int, max_batch_size: int) -> LargestBatch:
    traced: dict[int, ShardedEstimate] = {}

    def peak_at(batch_size: int) -> int:
        traced[batch_size] = trace(batch_size)
        return traced[batch_size].peak_bytes

    if peak_at(1) > capacity_bytes:
        return LargestBatch(0, capacity_bytes, traced[1], None, 1)
    if max_batch_size > 1:
        peak_at(2)
    while (size := _next_size(_history(traced), capacity_bytes, max_batch_size, _points(traced))) is not None:
        peak_at(size)
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


class PhaseLines:
    """``largest_batch_size``'s search as a search strategy, for one rank traced on fake tensors
    (a ``TraceDevice``): the sizes 1 and 2, then where the phases' lines reach the usable memory,
    confirmed by the size above (see ``_next_size``). A fake trial's peak is known also past the
    memory, which lets the lines aim from both sides.

    >>> from batchfit.search.strategies import SearchSpace
    >>> from batchfit.search.trial import Trial
    >>> space, lines = SearchSpace(1, 100, limit_bytes=1000), PhaseLines()
    >>> lines.next([], space), lines.next([Trial(1, True, 300, 0.1)], space)
    (1, 2)
    >>> lines.next([Trial(1, True, 300, 0.1), Trial(2, True, 400, 0.1)], space)
    8
    """

    name = "phase-lines"

    def next(self, trials: Any, space: Any) -> int | None:
        if not trials:
            return space.min_batch_size
        limit = space.limit_bytes
        if limit is None or not trials[0].fits:
            return None
        if len(trials) == 1:
            return trials[0].batch_size + 1 if trials[0].batch_size < space.max_batch_size else None
        history = [(t.batch_size, t.peak_bytes if t.fits else max(t.peak_bytes or 0, limit + 1)) for t in trials]
        points = {t.batch_size: dict(t.phase_peak_bytes) or {"step": t.peak_bytes} for t in trials if t.peak_bytes}
        return _next_size(history, limit, space.max_batch_size, points)
