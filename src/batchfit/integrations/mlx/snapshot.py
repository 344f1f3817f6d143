"""MlxSnapshot: parameters, optimizer state, RNG key and training flags, kept bitwise in host memory.

Each array is kept as its raw bytes in a NumPy buffer, so a snapshot restores -0.0, NaN payloads
and bfloat16 exactly, and costs nothing in MLX's memory: a trial's measured peak is what training
itself holds, not training plus a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx.utils import tree_map
from mlx.utils import tree_unflatten


@dataclass(frozen=True)
class HostArray:
    """An MLX array's dtype, shape and raw bytes, in host memory.

    >>> HostArray.of(mx.array([-0.0, 1.5], dtype=mx.bfloat16)).to_mlx().tolist()
    [-0.0, 1.5]
    """

    dtype: mx.Dtype
    shape: tuple[int, ...]
    bits: np.ndarray

    @classmethod
    def of(cls, array: mx.array) -> HostArray:
        return cls(array.dtype, tuple(array.shape), np.array(mx.view(array.reshape(-1), mx.uint8)))

    def to_mlx(self) -> mx.array:
        return mx.view(mx.array(self.bits), self.dtype).reshape(self.shape)


def _to_host(tree: Any) -> Any:
    return tree_map(lambda leaf: HostArray.of(leaf) if isinstance(leaf, mx.array) else leaf, tree)


def _to_mlx(tree: Any) -> Any:
    is_host = lambda leaf: isinstance(leaf, HostArray)  # noqa: E731
    return tree_map(lambda leaf: leaf.to_mlx() if is_host(leaf) else leaf, tree, is_leaf=is_host)


def _optimizers(optimizer: Any) -> list[Any]:
    """The optimizer and, for a ``MultiOptimizer``, the ones it holds."""
    return [] if optimizer is None else [optimizer, *getattr(optimizer, "optimizers", [])]


@dataclass
class MlxSnapshot:
    """What a probe may change, taken before it and put back after it.

    >>> model = nn.Linear(2, 2)
    >>> snapshot = MlxSnapshot.take(model, None)
    >>> before = mx.array(model.weight)
    >>> model.update({"weight": model.weight * 0})
    Linear(input_dims=2, output_dims=2, bias=True)
    >>> snapshot.restore()
    >>> mx.array_equal(model.weight, before).item()
    True
    """

    model: nn.Module
    optimizer: Any
    parameters: list[tuple[str, HostArray]]
    optimizer_state: Any
    initialized: list[tuple[Any, bool]]
    rng_key: HostArray
    training: list[tuple[nn.Module, bool]]

    @classmethod
    def take(cls, model: nn.Module, optimizer: Any) -> MlxSnapshot:
        """Evaluate what is still lazy, then copy it to host memory."""
        state = optimizer.state if optimizer is not None else None
        mx.eval(model.parameters(), state, mx.random.state[0])
        return cls(
            model=model,
            optimizer=optimizer,
            parameters=[(path, HostArray.of(value)) for path, value in tree_flatten(model.parameters())],
            optimizer_state=_to_host(state),
            # The state setter marks an optimizer uninitialised; the flag is put back as it was.
            initialized=[(opt, opt._initialized) for opt in _optimizers(optimizer) if hasattr(opt, "_initialized")],
            rng_key=HostArray.of(mx.random.state[0]),
            training=[(module, module.training) for module in model.modules()],
        )

    def restore(self) -> None:
        """Put everything back, bitwise: parameters, optimizer state, the global RNG key, train/eval flags."""
        self.model.update(tree_unflatten([(path, host.to_mlx()) for path, host in self.parameters]))
        if self.optimizer is not None:
            self.optimizer.state = _to_mlx(self.optimizer_state)
            for opt, flag in self.initialized:
                opt._initialized = flag
        key = mx.random.state[0]
        key[...] = self.rng_key.to_mlx()  # in place: the global RNG state holds this very array
        for module, flag in self.training:  # parents come first, so a parent's train() never undoes a child
            if module.training != flag:
                module.train(flag)
        mx.eval(self.model.parameters(), self.optimizer.state if self.optimizer is not None else None, key)
