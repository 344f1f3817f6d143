"""PhaseLines: the search strategy for sizes traced on fake tensors, led by the phases' lines.

Activations and backward's temporaries grow linearly in the batch while everything else (sharded
state, gathered parameters, buffers) stays, so each phase's peak (forward, backward, optimizer) is
a line in the batch and the step's peak is the highest of them: the lines through the traces at 1
and 2 (``MemoryModel.between``) predict the edge, also when the peak moves from one phase to
another between them and the edge (large models with activation checkpointing peak in the
optimizer step at small batches). The answer is then confirmed by tracing it and the size above
it. A trace knows its peak also past the memory, so once a size fails the lines run between the
fitting and the failing trace and aim from both sides. Where a trace disagrees with the lines
(allocator rounding, a curved peak), the search keeps the traced sizes that fit and do not, and
interpolates and halves between them, so the answer is always a traced size that fits next to a
traced size that does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from batchfit.search.memory_model import MemoryModel
from batchfit.search.strategies import SearchSpace
from batchfit.search.trial import Trial


class PhaseLines:
    """The search strategy on a trace (a ``TraceDevice``; what the per-rank search of
    ``batchfit.parallel.fit.largest_batch_size`` runs): the sizes 1 and 2, then where the phases'
    lines reach the usable memory, confirmed by the size above (see ``_next_size``).

    >>> space, lines = SearchSpace(1, 100, limit_bytes=1000), PhaseLines()
    >>> lines.next([], space), lines.next([Trial(1, True, 300, 0.1)], space)
    (1, 2)
    >>> lines.next([Trial(1, True, 300, 0.1), Trial(2, True, 400, 0.1)], space)
    8
    """

    name = "phase-lines"

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if not trials:
            return space.min_batch_size
        limit = space.limit_bytes
        if limit is None or not trials[0].fits:
            return None
        if len(trials) == 1:
            return trials[0].batch_size + 1 if trials[0].batch_size < space.max_batch_size else None
        return _next_size(trials, limit, space.max_batch_size)


def _edge(low: Trial, high: Trial, limit_bytes: int) -> int | None:
    """Where the first of the phases' lines through ``low`` and ``high`` reaches ``limit_bytes`` (``None``:
    no line rises, or a trace without a peak)."""
    model = MemoryModel.between(low, high)
    return None if model is None else model.max_batch_size(limit_bytes)


def _next_size(trials: Sequence[Trial], limit_bytes: int, max_batch_size: int) -> int | None:
    """The next size to trace after ``trials`` (in the order traced), or ``None`` once a fitting size sits
    next to a failing one (or the maximum fits). Unbracketed: the lines from the first fitting trace through
    the largest (doubling where all are flat). Bracketed: the lines between the bracket's ends, where they
    predict the edge at the fitting end, the size above it; after two traces on one side (lines creeping up
    on a curved peak), the bracket's middle."""
    by_size = {trial.batch_size: trial for trial in trials}
    fitting = sorted(trial.batch_size for trial in trials if trial.fits)
    failing = sorted(trial.batch_size for trial in trials if not trial.fits)
    lo, hi = fitting[-1], (failing[0] if failing else None)
    if (hi is not None and hi == lo + 1) or (hi is None and lo >= max_batch_size):
        return None
    if hi is None:
        guess = _edge(by_size[fitting[0]], by_size[lo], limit_bytes) if lo > fitting[0] else None
        return min(max(lo * 2 if guess is None else guess, lo + 1), max_batch_size)
    guess = _edge(by_size[lo], by_size[hi], limit_bytes)
    if guess is None or guess <= lo:
        return lo + 1
    if len(trials) > 3 and trials[-2].fits == trials[-1].fits:
        return (lo + hi) // 2
    return min(guess, hi - 1)
