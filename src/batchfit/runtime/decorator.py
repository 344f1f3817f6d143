"""executable_batch_size: run a function whose first argument is the batch size, shrinking on OOM.

accelerate's ``find_executable_batch_size`` has this shape; this one keeps every argument,
retries only on real out-of-memory errors, stops at a floor with a clear error, remembers the size
that worked for the next call (per instance, on a method), and can start from a search
(``probe=``) instead of a guess.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
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
# Functions whose body runs after the call returns, where no retry can reach an OOM.
DEFERRED_KINDS: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (inspect.isgeneratorfunction, "a generator function"),
    (inspect.iscoroutinefunction, "a coroutine function (async def)"),
    (inspect.isasyncgenfunction, "an async generator function"),
)


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


@dataclass
class Memory:
    """What one wrapper, or one instance's method, remembers across calls."""

    batch_size: int | None
    """The size the next call starts at (``None``: not known yet)."""
    history: list[tuple[int, str]] = field(default_factory=list)
    """Every ``(batch_size, "ok" | "oom")`` tried, in order."""
    probe_trials: list[Trial] = field(default_factory=list)
    """The probe's search, when ``probe=`` was given."""


class ExecutableBatchSize:
    """The wrapped function; ``batch_size`` is the size the next call starts at, ``history`` every
    ``(batch_size, "ok" | "oom")`` tried, across calls. On a method, each instance (each class, for
    a classmethod) remembers its own."""

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
        function, self.kind = _unwrap(function)
        _check_function(function)
        functools.update_wrapper(self, function)
        self.function = function
        self.signature = inspect.signature(function)
        self.start, self.min_batch_size, self.max_batch_size = start, min_batch_size, max_batch_size
        self.backoff, self.probe = backoff, probe
        self.memory = Memory(start)
        self.bound_to: tuple[Any, ...] = ()  # the instance (or class) a method is bound to
        self.through_class = False  # ``Owner.method(instance, ...)``: the instance comes first
        self._memories: dict[int, Memory] = {}  # by id() of a live instance or class

    @property
    def batch_size(self) -> int | None:
        """The size the next call starts at (``None`` until known)."""
        return self.memory.batch_size

    @property
    def history(self) -> list[tuple[int, str]]:
        """Every ``(batch_size, "ok" | "oom")`` tried, across calls."""
        return self.memory.history

    @property
    def probe_trials(self) -> list[Trial]:
        """The probe's search, when ``probe=`` was given."""
        return self.memory.probe_trials

    def __get__(self, instance: Any, owner: type | None = None) -> ExecutableBatchSize:
        """Bind as a method does: to the instance, or to the class for a classmethod; a staticmethod
        never binds."""
        if self.kind == "static":
            return self
        target = (owner or type(instance)) if self.kind == "class" else instance
        view = copy.copy(self)
        view.through_class = target is None
        if target is not None:
            view.bound_to, view.memory = (target,), self._memory_of(target)
        return view

    def _memory_of(self, target: Any) -> Memory:
        """``target``'s own memory, dropped when ``target`` is collected."""
        key = id(target)
        if key not in self._memories:
            try:
                weakref.finalize(target, self._memories.pop, key, None)
            except TypeError:
                name = type(target).__name__
                raise InputTypeError(
                    f"{self.__qualname__} remembers a batch size per instance, and {name} instances cannot "
                    f"be weakly referenced: add '__weakref__' to {name}.__slots__"
                ) from None
            self._memories[key] = Memory(self.start)
        return self._memories[key]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call at the first size, smaller after each OOM, until one works or the floor fails."""
        if self.through_class:
            return self._call_through_class(args, kwargs)
        self._check_call(args, kwargs)
        size = self._first_size()
        while True:
            done, result = _attempt(lambda b: self.function(*self.bound_to, b, *args, **kwargs), size)
            self.history.append((size, "ok" if done else "oom"))
            if done:
                self.memory.batch_size = size  # the next call starts where this one worked
                return result
            size = self._smaller(size)

    def _call_through_class(self, args: tuple, kwargs: dict) -> Any:
        """``Owner.method(instance, ...)`` runs as ``instance.method(...)``."""
        if not args:
            raise InputTypeError(
                f"{self.__qualname__}() needs the instance first: call it as instance.{self.__name__}(...)"
            )
        return self.__get__(args[0], type(args[0]))(*args[1:], **kwargs)

    def _first_size(self) -> int:
        """The remembered size, the probe's edge, or ``start`` (default 128), within the bounds."""
        if self.memory.batch_size is None and self.probe is not None:
            self.memory.probe_trials = search_with_probe(self.probe, self.min_batch_size, self.max_batch_size)
            space = SearchSpace(self.min_batch_size, self.max_batch_size or PROBE_CEILING)
            lo, _ = bracket(self.memory.probe_trials, space)
            if lo < self.min_batch_size:
                raise NoBatchFitsError(
                    f"the probe ran out of memory even at batch size {self.min_batch_size}: "
                    "lower min_batch_size or free memory",
                    self.memory.probe_trials,
                )
            self.memory.batch_size = lo
        size = self.memory.batch_size or DEFAULT_START
        return max(self.min_batch_size, min(size, self.max_batch_size or size))

    def _smaller(self, size: int) -> int:
        """The next size after an OOM at ``size``; ``NoBatchFitsError`` at the floor."""
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
        """The caller passes every argument but the batch size (and the bound instance)."""
        names = list(self.signature.parameters)
        batch = names[len(self.bound_to)] if len(names) > len(self.bound_to) else None
        if batch is not None and batch in kwargs:
            raise InputTypeError(
                f"{self.__name__}() got {batch}= from the caller: the decorator passes the batch size; "
                f"call {self.__name__}() without it"
            )
        try:
            self.signature.bind(*self.bound_to, 0, *args, **kwargs)
        except TypeError as error:
            raise InputTypeError(
                f"{self.__name__}{self.signature}: {error}. The decorator passes the batch size as the "
                f"first argument: call {self.__name__}() with the other arguments only"
            ) from None


def _unwrap(function: Any) -> tuple[Any, str]:
    """The plain function inside a ``staticmethod``/``classmethod``, and which of the three it was."""
    if isinstance(function, staticmethod):
        return function.__func__, "static"
    if isinstance(function, classmethod):
        return function.__func__, "class"
    return function, "function"


def _check_function(function: Any) -> None:
    """A plain callable, whose OOMs happen while it is called (not a generator or coroutine)."""
    if not callable(function):
        raise InputTypeError(
            f"executable_batch_size decorates a function(batch_size, ...), got {type(function).__name__}"
        )
    for test, kind in DEFERRED_KINDS:
        if test(function):
            raise InputTypeError(
                f"{function.__name__} is {kind}: it runs after the call returns, where an out-of-memory error "
                "cannot be retried; call it from a plain function that runs it to the end and decorate that"
            )


def _check(start: int | None, max_batch_size: int | None, min_batch_size: int, backoff: float, probe: Any) -> None:
    """Every setting, each with its fix."""
    for name, value in (("start", start), ("max_batch_size", max_batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{name} must be a positive integer or None, got {value!r}")
    if not isinstance(min_batch_size, int) or isinstance(min_batch_size, bool) or min_batch_size < 1:
        raise InputError(f"min_batch_size must be a positive integer, got {min_batch_size!r}")
    if max_batch_size is not None and max_batch_size < min_batch_size:
        raise InputError(f"max_batch_size ({max_batch_size}) must be at least min_batch_size ({min_batch_size})")
    if start is not None and start < min_batch_size:
        raise InputError(
            f"start ({start}) is below min_batch_size ({min_batch_size}): raise start or lower min_batch_size"
        )
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

    On a method, ``self`` comes first and the batch size second; each instance remembers its own
    size. Put ``@staticmethod`` or ``@classmethod`` below it (or ``@staticmethod`` above). Generator
    and ``async def`` functions are refused: their body runs after the call returns.

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
    >>> class Trainer:
    ...     def __init__(self, limit):
    ...         self.limit = limit
    ...     @executable_batch_size(start=64)
    ...     def fit(self, batch_size, epochs=1):
    ...         if batch_size > self.limit:
    ...             raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ...         return batch_size, epochs
    >>> small, large = Trainer(16), Trainer(40)
    >>> small.fit(epochs=2), large.fit()
    ((16, 2), (32, 1))
    >>> small.fit.history, large.fit.history
    ([(64, 'oom'), (32, 'oom'), (16, 'ok')], [(64, 'oom'), (32, 'ok')])
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
