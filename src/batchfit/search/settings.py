"""SearchSettings: how a search runs, checked once and passed along as one frozen value.

Every entry point that searches (``find_max_batch_size``, ``find_optimal_batch_size``, the sweep,
the Microbatcher, the integrations) takes the same keywords and builds one of these; everything
below them reads it instead of re-listing a dozen arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchfit.bounds import LARGEST_SIZE
from batchfit.bounds import check_steps_count
from batchfit.devices.units import parse_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.search.cached import CacheSpec
from batchfit.search.cached import check_cache
from batchfit.search.prober import check_steps
from batchfit.search.strategies import Strategy
from batchfit.search.strategies import make_strategy


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a size


def check_bounds(min_batch_size: int, max_batch_size: int | None, max_trials: int | None) -> None:
    """A ``ValueError`` naming the bad bound: sizes are integers ``1 <= min <= max <= LARGEST_SIZE``,
    ``max_trials >= 1``."""
    if not _is_count(min_batch_size) or min_batch_size < 1:
        raise InputError(f"min_batch_size must be an integer of at least 1, got {min_batch_size!r}")
    for name, size in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
        if _is_count(size) and size > LARGEST_SIZE:
            raise InputError(f"{name} must be at most {LARGEST_SIZE:,} (2**31 - 1), got {size}")
    if max_batch_size is not None and (not _is_count(max_batch_size) or max_batch_size < min_batch_size):
        raise InputError(
            f"max_batch_size must be an integer >= min_batch_size ({min_batch_size}), got {max_batch_size!r}"
        )
    if max_trials is not None and (not _is_count(max_trials) or max_trials < 1):
        raise InputError(f"max_trials must be an integer of at least 1, or None, got {max_trials!r}")


def check_seconds(max_seconds: float | None) -> None:
    """A one-line error unless ``max_seconds`` is ``None`` or a positive number of seconds."""
    if max_seconds is None:
        return
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)):
        raise InputTypeError(f"max_seconds must be a number of seconds or None, got {max_seconds!r}")
    if not max_seconds > 0:
        raise InputError(f"max_seconds must be above 0, got {max_seconds!r}: give the seconds a search may take")


def margin_bytes(margin: int | float | str, capacity_bytes: int | None) -> int:
    """Headroom in bytes: an int or a size string, or a fraction of the capacity in ``[0, 1)``."""
    if isinstance(margin, bool):
        raise InputTypeError(f"margin must be bytes, a size string or a fraction, got {margin!r}")
    if isinstance(margin, float):
        if not 0 <= margin < 1:
            raise InputError(f"a fractional margin must be in [0, 1), got {margin=}")
        return int(margin * capacity_bytes) if capacity_bytes else 0
    if margin == 0:
        return 0
    return parse_bytes(margin, what="margin")


@dataclass(frozen=True)
class SearchSettings:
    """How a search runs. Checked when built, so a bad value fails before any trial.

    >>> SearchSettings(max_batch_size=64, margin=0.05).replace(strategy="binary").strategy
    'binary'
    >>> SearchSettings(min_batch_size=0)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: min_batch_size must be an integer of at least 1, got 0
    """

    min_batch_size: int = 1
    """The smallest size to consider; a search that cannot fit it raises ``NoBatchFitsError``."""
    max_batch_size: int | None = None
    """The caller's cap on the sizes tried (``None``: derived from the free memory)."""
    strategy: str | Strategy = "auto"
    """``auto``, ``binary``, ``power``, ``grow``, ``halving``, or an object with ``.next(trials, space)``."""
    margin: int | float | str = 0
    """Headroom kept free: bytes, a size string such as ``"512MiB"``, or a fraction such as ``0.05``."""
    max_trials: int | None = None
    """Stop after this many trials (the result is then marked not ``exact``)."""
    max_seconds: float | None = None
    """Start no trial after this many seconds since the search began (the trace included), nor one
    predicted to end past them (at the largest fitted trial's seconds per sample): the answer is
    the largest size confirmed so far, marked not ``exact``."""
    steps: int = 2
    """Full training steps per trial; two or more include the optimizer state of a steady step."""
    trace: bool | str = "auto"
    """With the ``auto`` strategy: ``"auto"`` spends the cheaper evidence first (the trace on fake
    tensors where a real trial is expensive, else real trials, deciding after the first one; see
    ``batchfit.search.evidence``), ``True`` always estimates the edge on the trace first, ``False``
    never traces."""
    cache: CacheSpec = False
    """``True``, a folder or a ``ResultCache``: answer a search that ran before with zero trials."""
    agree: bool | None = None
    """Make all ranks agree on every trial (default: when a process group is initialised)."""
    confirm_steps: int | None = None
    """Where a caching allocator decides what fits (a GPU, or a simulated device that models one), the
    answer is tried once more for this many full steps in a row, from an emptied cache as training starts,
    and lower sizes until one holds: the allocator's state after a few steps is what training meets
    (``None``: 4 there, none elsewhere; ``0``: never)."""

    def __post_init__(self) -> None:
        check_bounds(self.min_batch_size, self.max_batch_size, self.max_trials)
        check_seconds(self.max_seconds)
        check_steps(self.steps)
        make_strategy(self.strategy)  # an unknown name fails here, naming the strategies
        if self.trace not in (True, False, "auto") or not isinstance(self.trace, (bool, str)):
            raise InputTypeError(f"trace must be 'auto', True or False, got {self.trace!r}")
        margin_bytes(self.margin, None)  # its form: bytes, a size string, or a fraction in [0, 1)
        check_cache(self.cache)
        if self.confirm_steps is not None:
            check_steps_count("confirm_steps (0: no confirmation)", self.confirm_steps, smallest=0)
        if self.agree not in (None, True, False):
            raise InputTypeError(
                f"agree must be True, False or None (when a process group is initialised), got {self.agree!r}"
            )

    def replace(self, **changes: Any) -> SearchSettings:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def merged(cls, settings: SearchSettings | None = None, **keywords: Any) -> SearchSettings:
        """What an entry point was given: ``settings``, or its flat keywords (``min_batch_size=...``, kept as
        aliases), those left at their defaults counting as not given; both at once is refused, so that no
        setting is silently overridden.

        >>> SearchSettings.merged(None, max_trials=5, margin=0).max_trials
        5
        >>> SearchSettings.merged(SearchSettings(max_trials=5), margin="1GiB")
        Traceback (most recent call last):
        ...
        batchfit.errors.InputError: give the search settings once: settings=SearchSettings(...) or the keyword margin, not both (settings.replace(margin=...) changes one)
        """
        defaults = {field.name: field.default for field in dataclasses.fields(cls)}
        given = {  # True is not the default 1: a wrong type given is checked, not dropped
            name: value
            for name, value in keywords.items()
            if type(value) is not type(defaults[name]) or value != defaults[name]
        }
        if settings is not None and given:
            names = ", ".join(given)
            raise InputError(
                f"give the search settings once: settings=SearchSettings(...) or the keyword{'s' * (len(given) > 1)} "
                f"{names}, not both (settings.replace({next(iter(given))}=...) changes one)"
            )
        return cls.of(settings, **given)

    @classmethod
    def of(cls, settings: SearchSettings | None = None, **changes: Any) -> SearchSettings:
        """``settings`` (default: the defaults) with ``changes``: how entry points take both forms."""
        base = settings if settings is not None else cls()
        if not isinstance(base, cls):
            raise InputTypeError(f"settings must be a batchfit SearchSettings, got {type(base).__name__}")
        return base.replace(**changes) if changes else base
