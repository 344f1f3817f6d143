"""Search strategies: given the trials so far, name the next batch size, or ``None`` when done.

Strategies never touch a model, so each is tested against a plain ``fits(b)`` function. Every
one keeps to the bracket ``(lo, hi)`` (largest size that fitted below the smallest size that
failed), so the answer is always a size that was actually tried.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.search.memory_model import MemoryModel
from batchfit.search.trial import Trial


@dataclass(frozen=True)
class SearchSpace:
    """The sizes allowed, ``[min_batch_size, max_batch_size]``, and the usable bytes, if known."""

    min_batch_size: int
    max_batch_size: int
    limit_bytes: int | None = None


class Strategy(Protocol):
    name: str

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None: ...


def bracket(trials: Sequence[Trial], space: SearchSpace) -> tuple[int, int]:
    """``(lo, hi)``: the largest fitting size below the smallest failing one (``min - 1`` if none
    fitted) and that smallest failing size (``max + 1`` if none failed)."""
    hi = min((t.batch_size for t in trials if not t.fits), default=space.max_batch_size + 1)
    lo = max((t.batch_size for t in trials if t.fits and t.batch_size < hi), default=space.min_batch_size - 1)
    return lo, hi


def _midpoint(lo: int, hi: int) -> int:
    return (lo + hi) // 2


def _grow_or_bisect(lo: int, hi: int, space: SearchSpace, factor: float) -> int:
    """Grow from ``lo`` by ``factor`` while nothing has failed, else bisect."""
    if hi > space.max_batch_size:
        return min(max(int(lo * factor), lo + 1), space.max_batch_size)
    return _midpoint(lo, hi)


class Binary:
    """The classic recipe: bisection on ``[min_batch_size, max_batch_size]``, starting in the middle."""

    name = "binary"

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        lo, hi = bracket(trials, space)
        return None if hi - lo <= 1 else _midpoint(lo, hi)


class Power:
    """Lightning's ``binsearch``: from ``min_batch_size``, double until a failure, then bisect."""

    name = "power"

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        lo, hi = bracket(trials, space)
        if hi - lo <= 1:
            return None
        if lo < space.min_batch_size:
            return space.min_batch_size
        return _grow_or_bisect(lo, hi, space, 2.0)


class Grow:
    """Estimate-then-grow: start at an estimate, x1.5 up to the cap; after a failure with nothing fitting,
    halve; then bisect between the last fit and the first failure."""

    name = "grow"

    def __init__(self, start: int | None = None, factor: float = 1.5):
        if factor <= 1:
            raise InputError(f"grow factor must be above 1, got {factor=}")
        self.start = start
        self.factor = factor

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        lo, hi = bracket(trials, space)
        if hi - lo <= 1:
            return None
        if not trials:
            start = self.start or space.min_batch_size
            return min(max(start, space.min_batch_size), space.max_batch_size)
        if lo < space.min_batch_size:
            return max(hi // 2, space.min_batch_size)
        return _grow_or_bisect(lo, hi, space, self.factor)


class Halving:
    """accelerate's top-down back-off: start at the top, halve until a fit, then bisect up."""

    name = "halving"

    def __init__(self, start: int | None = None):
        self.start = start

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        lo, hi = bracket(trials, space)
        if hi - lo <= 1:
            return None
        if not trials:
            return min(self.start or space.max_batch_size, space.max_batch_size)
        if lo < space.min_batch_size:
            return max(hi // 2, space.min_batch_size)
        return _midpoint(lo, hi)


def _failures_at_end(trials: Sequence[Trial]) -> int:
    count = 0
    for trial in reversed(trials):
        if trial.fits:
            break
        count += 1
    return count


class Auto:
    """The default. Probe ``min_batch_size`` (or ``guess``, an estimate such as the trace's),
    fit peak bytes against batch size (see ``MemoryModel``), jump to the predicted edge, verify
    it fits and that one more does not; refine with every new point. A guess that fails is tried
    5% lower once, then the minimum is measured so the model can aim. After a miss above the edge
    it steps down geometrically from the failure; past ``bisect_after`` trials since the first
    fit it gallops up from the last fit (2%, 4%, 8%, ... more) until a size fails, then bisects;
    with no capacity to aim at, it doubles until a failure, then bisects.
    """

    name = "auto"

    def __init__(self, bisect_after: int = 6, gallop_fraction: float = 0.01, guess: int | None = None):
        self.bisect_after = bisect_after
        self.gallop_fraction = gallop_fraction
        self.guess = guess

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if not trials and self.guess is not None:
            return min(max(self.guess, space.min_batch_size), space.max_batch_size)
        lo, hi = bracket(trials, space)
        if hi - lo <= 1:
            return None
        tried = {t.batch_size for t in trials}
        if self.guess is not None and lo < self.guess < hi and self.guess not in tried:
            return self.guess  # an estimate that came after the first trials: it goes next
        if lo < space.min_batch_size:
            return self._below_first_fit(trials, space, hi)
        if lo == self.guess and lo + 1 not in tried:
            return lo + 1  # the estimate fitted: confirm the edge before anything else
        model = MemoryModel.fit(trials)
        edge = None if model is None or space.limit_bytes is None else model.max_batch_size(space.limit_bytes)
        aimed = len(trials) - next(i for i, t in enumerate(trials) if t.fits)  # a failed guess's trials don't count
        if edge is None:
            return _grow_or_bisect(lo, hi, space, 2.0)
        if aimed >= self.bisect_after:  # the model keeps missing: gallop up from the last fit, or bisect
            beyond = aimed - self.bisect_after
            return _grow_or_bisect(lo, hi, space, 1 + self.gallop_fraction * 2 ** (beyond + 1))
        misses = _failures_at_end(trials)
        if misses:
            step = max(1, math.ceil(hi * self.gallop_fraction * 2 ** (misses - 1)))
            edge = min(edge, hi - step)
        return min(max(edge, lo + 1), hi - 1)

    def _below_first_fit(self, trials: Sequence[Trial], space: SearchSpace, hi: int) -> int:
        """Nothing has fitted yet: start at the minimum; after a failed guess step 5% below it (an
        estimate is usually close); when that fails too the estimate is off, so measure the minimum
        and let the memory model aim; without a guess, halve."""
        if not trials:
            return space.min_batch_size
        if self.guess is None or len(trials) >= 2:
            tried = {trial.batch_size for trial in trials}
            return space.min_batch_size if space.min_batch_size not in tried else max(hi // 2, space.min_batch_size)
        return max(hi - math.ceil(hi * 0.05), space.min_batch_size)


STRATEGIES: dict[str, type] = {cls.name: cls for cls in (Auto, Binary, Power, Grow, Halving)}


def strategy_name(strategy: Strategy) -> str:
    """A strategy's ``name``, or its class's name for an object of the caller's without one.

    >>> strategy_name(make_strategy("binary"))
    'binary'
    """
    name = getattr(strategy, "name", None)
    return name if isinstance(name, str) else type(strategy).__name__


def make_strategy(strategy: str | Strategy, **options: object) -> Strategy:
    """A strategy from its name (``auto``, ``binary``, ``power``, ``grow``, ``halving``) or as given."""
    if not isinstance(strategy, str):
        if not callable(getattr(strategy, "next", None)):
            raise InputTypeError(f"strategy must be a name or an object with .next(trials, space), got {strategy!r}")
        return strategy
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy](**options)
