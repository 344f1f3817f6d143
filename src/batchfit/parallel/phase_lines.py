"""PhaseLines: the search strategy for one rank traced on fake tensors, led by the phases' lines.

Activations and backward's temporaries grow linearly in the micro-batch while everything else
(sharded state, gathered parameters, buffers) stays, so each phase's peak (forward, backward,
optimizer) is a line in the micro-batch and the step's peak is the highest of them: the lines
through the traces at 1 and 2 predict the edge, also when the peak moves from one phase to
another between them and the edge (large models with activation checkpointing peak in the
optimizer step at small batches). The answer is then confirmed by tracing it and the size above
it. Where a trace disagrees with the lines (allocator rounding, a curved peak), the search keeps
the traced sizes that fit and do not, and interpolates and halves between them, so the answer is
always a traced size that fits next to a traced size that does not.
"""

from __future__ import annotations

from typing import Any

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


class PhaseLines:
    """The search strategy of one rank traced on fake tensors (a ``TraceDevice``; what
    ``largest_batch_size`` runs): the sizes 1 and 2, then where the phases' lines reach the usable
    memory, confirmed by the size above (see ``_next_size``). A fake trial's peak is known also past
    the memory, which lets the lines aim from both sides.

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
