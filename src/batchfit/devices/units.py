"""Byte quantities: parse "8GiB"-style strings (``parse_bytes``) and print sizes for people (``format_bytes``,
defined in ``batchfit.devices.byte_format``, which imports nothing: ``errors`` hints ``Trial``, which prints sizes)."""

from __future__ import annotations

import re

from batchfit.devices.byte_format import format_bytes as format_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError

_MULTIPLIERS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, what: str = "capacity", allow_zero: bool = False) -> int:
    """Return a byte count from an int or a string such as ``"512MiB"``, ``"8GiB"``, ``"1.5GB"``
    (zero only with ``allow_zero``, e.g. for a reserve).

    >>> parse_bytes("1.5GiB")
    1610612736
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputTypeError(f"{what} must be a byte count or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0 or (value == 0 and not allow_zero):
            raise InputError(f"{what} must be positive, got {value}")
        return value
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _MULTIPLIERS:
        raise InputError(f"{what} {value!r} is not a size: write it like '512MiB', '8GiB' or '1.5GB'")
    count = int(float(match.group(1)) * _MULTIPLIERS[unit])
    if count < 0 or (count == 0 and not allow_zero):
        raise InputError(f"{what} must be positive, got {value!r}")
    return count
