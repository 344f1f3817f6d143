"""Byte quantities: parse "8GiB"-style strings and print sizes for people."""

from __future__ import annotations

import re

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


def format_bytes(count: int | float | None) -> str:
    """Print a byte count with a binary unit: ``format_bytes(3 * 2**30) == "3.0 GiB"``."""
    if count is None:
        return "?"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
