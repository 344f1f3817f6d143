"""executable_batch_size: run a function whose first argument is the batch size, shrinking on OOM.

accelerate's ``find_executable_batch_size`` has this shape; this one keeps every argument,
retries only on real out-of-memory errors, stops at a floor with a clear error, remembers the size
that worked for the next call, and can start from a search (``probe=``) instead of a guess.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from batchfit.devices.cleanup import free_memory
from batchfit.devices.oom import is_oom
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.errors import NoBatchFitsError
from batchfit.search.strategies import Power
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import bracket
from batchfit.search.trial import Trial

logger = logging.getLogger("batchfit")

F = TypeVar("F", bound=Callable[..., Any])
DEFAULT_START = 128  # accelerate's starting_batch_size
PROBE_CEILING = 1 << 16  # the probe's upper bound when no max_batch_size is given


def _attempt(function: Callable[[int], Any], batch_size: int) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, None)`` after a real OOM (cleaned up outside the except
    block, whose traceback holds the failed call's tensors). Any other error propagates."""
    try:
        return True, function(batch_size)
    except BaseException as error:
        if not is_oom(error):
            raise
    free_memory()
    return False, None


def search_with_probe(probe: Callable[[int], Any], min_batch_size: int, max_batch_size: int | None) -> list[Trial]:
    """Power-of-two growth from ``min_batch_size``, then bisection (the library's ``power`` strategy),
    calling ``probe(batch_size)``: the trials, in order."""
    space = SearchSpace(min_batch_size, max_batch_size or PROBE_CEILING)
    strategy, trials = Power(), []
    while (size := strategy.next(trials, space)) is not None:
        start = time.perf_counter()
        fits, _ = _attempt(probe, size)
        trials.append(
            Trial(size, fits, None, time.perf_counter() - start, None if fits else "out of memory", oom=not fits)
        )
    return trials


class ExecutableBatchSize:
    """The wrapped function; ``batch_size`` is the size the next call starts at, ``history`` every
    ``(batch_size, "ok" | "oom")`` tried, across calls."""

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        start: int | None,
        max_batch_size: int | None,
        min_batch_size: int,
        backoff: float,
        probe: Callable[[int], Any] | None,
    ):
        _check(start, max_batch_size, min_batch_size, backoff, probe)
        functools.update_wrapper(self, function)
        self.function = function
        self.signature = inspect.signature(function)
        self.min_batch_size, self.max_batch_size, self.backoff, self.probe = (
            min_batch_size,
            max_batch_size,
            backoff,
            probe,
        )
        self.batch_size: int | None = start
        self.history: list[tuple[int, str]] = []
        self.probe_trials: list[Trial] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_call(args, kwargs)
        size = self._first_size()
        while True:
            done, result = _attempt(lambda b: self.function(b, *args, **kwargs), size)
            self.history.append((size, "ok" if done else "oom"))
            if done:
                self.batch_size = size  # the next call starts where this one worked
                return result
            size = self._smaller(size)

    def _first_size(self) -> int:
        if self.batch_size is None and self.probe is not None:
            self.probe_trials = search_with_probe(self.probe, self.min_batch_size, self.max_batch_size)
            lo, _ = bracket(self.probe_trials, SearchSpace(self.min_batch_size, self.max_batch_size or PROBE_CEILING))
            if lo < self.min_batch_size:
                raise NoBatchFitsError(
                    f"the probe ran out of memory even at batch size {self.min_batch_size}: "
                    "lower min_batch_size or free memory",
                    self.probe_trials,
                )
            self.batch_size = lo
        size = self.batch_size or min(DEFAULT_START, self.max_batch_size or DEFAULT_START)
        return min(size, self.max_batch_size) if self.max_batch_size else size

    def _smaller(self, size: int) -> int:
        if size <= self.min_batch_size:
            raise NoBatchFitsError(
                f"{self.__name__} ran out of memory even at batch size {size} (the floor, min_batch_size="
                f"{self.min_batch_size}): lower min_batch_size, use gradient accumulation, or free memory",
                [],
            )
        smaller = max(self.min_batch_size, min(size - 1, int(size * self.backoff)))
        logger.warning("batchfit: %s ran out of memory at batch size %d; retrying at %d", self.__name__, size, smaller)
        return smaller

    def _check_call(self, args: tuple, kwargs: dict) -> None:
        first = next(iter(self.signature.parameters), None)
        if first is not None and first in kwargs:
            raise InputTypeError(
                f"{self.__name__}() got {first}= from the caller: the decorator passes the batch size; "
                f"call {self.__name__}() without it"
            )
        try:
            self.signature.bind(0, *args, **kwargs)
        except TypeError as error:
            raise InputTypeError(
                f"{self.__name__}{self.signature}: {error}. The decorator passes the batch size as the "
                f"first argument: call {self.__name__}() with the other arguments only"
            ) from None


def _check(start: int | None, max_batch_size: int | None, min_batch_size: int, backoff: float, probe: Any) -> None:
    for name, value in (("start", start), ("max_batch_size", max_batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{name} must be a positive integer or None, got {value!r}")
    if not isinstance(min_batch_size, int) or min_batch_size < 1:
        raise InputError(f"min_batch_size must be a positive integer, got {min_batch_size!r}")
    if max_batch_size is not None and max_batch_size < min_batch_size:
        raise InputError(f"max_batch_size ({max_batch_size}) must be at least min_batch_size ({min_batch_size})")
    if not isinstance(backoff, (int, float)) or not 0 < backoff < 1:
        raise InputError(f"backoff must be a factor in (0, 1), e.g. 0.5 to halve, got {backoff!r}")
    if probe is not None and not callable(probe):
        raise InputTypeError(
            f"probe must be a callable probe(batch_size) that runs one step, got {type(probe).__name__}"
        )


def executable_batch_size(
    function: F | None = None,
    *,
    start: int | None = None,
    max_batch_size: int | None = None,
    min_batch_size: int = 1,
    backoff: float = 0.5,
    probe: Callable[[int], Any] | None = None,
) -> Any:
    """Decorate ``function(batch_size, *args, **kwargs)`` (a training or evaluation loop): it is
    called at ``start`` (default 128, at most ``max_batch_size``) and, on a real out-of-memory
    error, cleaned up and called again at ``backoff`` times the size, down to ``min_batch_size``
    (then ``NoBatchFitsError``). The size that worked is where the next call starts. With
    ``probe(batch_size)`` (one cheap step) the first call searches upward and by bisection for
    the largest size that fits and starts there. Other errors propagate at once.

    >>> import torch
    >>> @executable_batch_size(start=64)
    ... def train(batch_size, epochs, lr=0.1):
    ...     if batch_size > 20:
    ...         raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ...     return batch_size, epochs, lr
    >>> train(3, lr=0.5)
    (16, 3, 0.5)
    >>> train.history
    [(64, 'oom'), (32, 'oom'), (16, 'ok')]
    """

    def decorate(inner: F) -> ExecutableBatchSize:
        return ExecutableBatchSize(
            inner,
            start=start,
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size,
            backoff=backoff,
            probe=probe,
        )

    return decorate(function) if function is not None else decorate
