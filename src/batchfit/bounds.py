"""One bound for every size, length and count a user gives: an integer from 1 (or another floor) to
``LARGEST_SIZE``, checked once where it enters. No tensor dimension past ``2**31 - 1`` can be built on any device
torch runs on, so a larger batch, sequence length or count is a mistake to name in one line, not a request to
pad a sample to 35 TB on the host, run a billion steps or scan a range for minutes.
"""

from __future__ import annotations

from typing import Any

from batchfit.errors import InputError
from batchfit.errors import InputTypeError

LARGEST_SIZE = 2**31 - 1  # no tensor dimension past this can be built on any device torch runs on


def check_size(name: str, value: Any, *, smallest: int = 1, largest: int = LARGEST_SIZE) -> int:
    """``value`` as an int in ``[smallest, largest]``: a bool, float or text is an ``InputTypeError``, an int out
    of range an ``InputError``, each naming ``name`` and the range.

    >>> check_size("seq_len", 1024)
    1024
    >>> check_size("seq_len", 10**30)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: seq_len must be at most 2,147,483,647 (2**31 - 1), got 1000000000000000000000000000000
    >>> check_size("batch_size", True)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputTypeError: batch_size must be an integer such as 8, got True
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an integer such as 8, got {value!r}")
    if value < smallest:
        raise InputError(f"{name} must be at least {smallest}, got {value}")
    if value > largest:
        limit = f"{largest:,}" + (" (2**31 - 1)" if largest == LARGEST_SIZE else "")
        raise InputError(f"{name} must be at most {limit}, got {value}")
    return value


def check_flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """``value`` when it is ``True`` or ``False`` (or ``None`` where ``optional``): ``"no"``, ``0`` or ``"false"`` are
    not read as a flag, which would be true for the first and silently mean something else for the others.

    >>> check_flag("packed", False), check_flag("packed", None, optional=True)
    (False, None)
    >>> check_flag("packed", "no")
    Traceback (most recent call last):
    ...
    batchfit.errors.InputTypeError: packed must be True or False, got 'no'
    """
    if isinstance(value, bool) or (optional and value is None):
        return value
    either = "True, False or None" if optional else "True or False"
    raise InputTypeError(f"{name} must be {either}, got {value!r}")


MOST_STEPS = 1000  # a trial, or its confirmation, of more steps than this is a training run, not a measurement


def check_steps_count(name: str, value: Any, *, smallest: int = 1) -> int:
    """``value`` as a number of training steps a measurement takes: ``smallest`` to ``MOST_STEPS``.

    >>> check_steps_count("confirm_steps", 4, smallest=0)
    4
    >>> check_steps_count("confirm_steps", 10**9, smallest=0)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: confirm_steps must be at most 1,000, got 1000000000
    """
    return check_size(name, value, smallest=smallest, largest=MOST_STEPS)
