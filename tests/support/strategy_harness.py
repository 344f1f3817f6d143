"""Run a strategy against a plain ``fits(b)`` function, with synthetic linear peaks for ``auto``."""

from __future__ import annotations

from collections.abc import Callable

import batchfit as bf
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import bracket


def linear_peak(base_bytes: int, per_sample_bytes: int) -> Callable[[int], int]:
    return lambda b: base_bytes + per_sample_bytes * b


def run_strategy(
    strategy: bf.search.strategies.Strategy,
    space: SearchSpace,
    fits: Callable[[int], bool],
    peak: Callable[[int], int] | None = None,
    max_trials: int = 200,
    held_bytes: int | None = None,
) -> tuple[list[int], int | None]:
    """The sizes tried in order, and the answer (``None`` when nothing fitted)."""
    trials: list[bf.Trial] = []
    while len(trials) < max_trials:
        size = strategy.next(trials, space)
        if size is None:
            break
        assert space.min_batch_size <= size <= space.max_batch_size, size
        assert size not in {t.batch_size for t in trials}, f"{size} proposed twice"
        ok = fits(size)
        peak_bytes = peak(size) if peak is not None and ok else None
        phases = {"backward": peak_bytes} if peak_bytes is not None else {}
        trials.append(
            bf.Trial(size, ok, peak_bytes, 0.0, None if ok else "oom", phases, 2, oom=not ok, held_bytes=held_bytes)
        )
    lo, _hi = bracket(trials, space)
    return [t.batch_size for t in trials], (lo if lo >= space.min_batch_size else None)
