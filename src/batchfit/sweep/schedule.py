"""The order a parallel sweep sends its configurations in: the grid's extremes first, then the rest, each
started from the memory model fitted across the records that have arrived (``crossconfig``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

FITTED_AFTER = 2  # the memory model needs two measured configurations


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def extremes(configs: Sequence[Mapping[str, Any]]) -> list[int]:
    """The positions of the grid's corners: every numeric knob at its smallest or largest value (a knob
    that is not numeric may take any value). They bound what the memory model is fitted over, so the
    configurations between them are interpolated, not extrapolated.

    >>> grid = [{"seq_len": s, "layers": n} for s in (8, 16, 32) for n in (1, 2)]
    >>> [(grid[i]["seq_len"], grid[i]["layers"]) for i in extremes(grid)]
    [(8, 1), (8, 2), (32, 1), (32, 2)]
    """
    if not configs:
        return []
    bounds = {}
    for name in configs[0]:
        values = [config.get(name) for config in configs]
        if all(_numeric(value) for value in values):
            bounds[name] = (min(values), max(values))
    return [i for i, config in enumerate(configs) if all(config[k] in bound for k, bound in bounds.items())]


def extremes_first(configs: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The configurations with the extremes first (in grid order), then the rest; and how many extremes.

    >>> extremes_first([{"seq_len": s} for s in (8, 16, 32, 64)])
    ([{'seq_len': 8}, {'seq_len': 64}, {'seq_len': 16}, {'seq_len': 32}], 2)
    """
    first = extremes(configs)
    chosen = set(first)
    ordered = [dict(configs[i]) for i in first] + [dict(c) for i, c in enumerate(configs) if i not in chosen]
    return ordered, len(first)
