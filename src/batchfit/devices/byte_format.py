"""Byte counts printed for people. Imports nothing of batchfit, so every module may print sizes, ``Trial`` too
(which ``batchfit.errors`` names in its hints); ``batchfit.devices.units`` re-exports it beside ``parse_bytes``."""

from __future__ import annotations


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
