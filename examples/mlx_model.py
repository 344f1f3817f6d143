"""An MLX workload for ``batchfit find --framework mlx``: a small MLP classifier trained with AdamW.

    batchfit find examples/mlx_model.py:make --framework mlx --device mlx:4MiB

``make`` returns a ``batchfit.integrations.mlx.MlxWorkload`` (model, one sample batch, loss,
optimizer): the same calling convention as a torch ``batchfit.Workload``. On Apple silicon the
capacity is Metal's; elsewhere give one (``--device mlx:4MiB``). ``pip install "batchfit[mlx]"``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from batchfit.integrations.mlx import MlxWorkload


def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    return nn.losses.cross_entropy(logits, labels, reduction="mean")


def make(features: int = 32, hidden: int = 128, classes: int = 10, sample_size: int = 8) -> MlxWorkload:
    """The MLP, one ``(features, labels)`` sample batch, cross-entropy and AdamW."""
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, classes))
    batch = (mx.random.normal((sample_size, features)), mx.random.randint(0, classes, (sample_size,)))
    return MlxWorkload(model, batch, cross_entropy, optim.AdamW(learning_rate=1e-3))
