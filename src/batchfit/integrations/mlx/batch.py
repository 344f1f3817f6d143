"""Batches of MLX arrays in any nesting: find their arrays, check their length, build a batch of any size.

Tuples, lists, namedtuples, mappings and dataclasses are walked; every ``mx.array`` with a leading
batch dimension is resized by cycling the sample's rows, as for torch (``batchfit.step.batching``).
NumPy arrays in a sample are turned into MLX arrays once, by ``as_mlx``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from batchfit.step.batching import common_length


def map_leaves(fn: Callable[[Any], Any], batch: Any, kinds: tuple[type, ...] = (mx.array,)) -> Any:
    """Apply ``fn`` to every leaf of ``batch`` that is one of ``kinds``, keeping the structure and other leaves.

    >>> map_leaves(lambda a: a.shape, {"x": mx.zeros((2, 3)), "tag": "a"})
    {'x': (2, 3), 'tag': 'a'}
    """
    if isinstance(batch, kinds):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {key: map_leaves(fn, value, kinds) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_leaves(fn, value, kinds) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_leaves(fn, value, kinds) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {f.name: map_leaves(fn, getattr(batch, f.name), kinds) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **changes)
    return batch


def as_mlx(batch: Any) -> Any:
    """``batch`` with every NumPy array turned into an MLX array (MLX arrays are kept)."""
    return map_leaves(mx.array, batch, kinds=(np.ndarray,))


def array_leaves(batch: Any) -> list[mx.array]:
    """Every MLX array in ``batch``, in traversal order."""
    found: list[mx.array] = []
    map_leaves(found.append, batch)
    return found


def batch_length(batch: Any) -> int:
    """The leading (batch) dimension shared by every non-scalar array of ``batch``.

    >>> batch_length((mx.zeros((4, 8)), mx.zeros((4,))))
    4
    """
    return common_length({a.shape[0] for a in array_leaves(batch) if a.ndim > 0}, "MLX array")


def batch_bytes(batch: Any) -> int:
    """Bytes of the arrays with a batch dimension."""
    return sum(a.nbytes for a in array_leaves(batch) if a.ndim > 0)


def bytes_per_sample(batch: Any) -> int:
    """Bytes one sample adds to the batch (rounded up).

    >>> bytes_per_sample({"x": mx.zeros((4, 8)), "y": mx.zeros((4,), dtype=mx.int32)})
    36
    """
    return max(1, -(-batch_bytes(batch) // batch_length(batch)))


def resize_batch(batch: Any, batch_size: int) -> Any:
    """A batch of ``batch_size`` rows built from ``batch``'s rows, cycled (``arange(B) % n``); scalars kept.

    >>> resize_batch(mx.array([10, 11, 12]), 5).tolist()
    [10, 11, 12, 10, 11]
    """
    rows = mx.arange(batch_size) % batch_length(batch)
    return map_leaves(lambda a: a if a.ndim == 0 else mx.take(a, rows, axis=0), batch)
