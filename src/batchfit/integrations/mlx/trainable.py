"""MlxTrainable: what the MLX prober and backend use of a workload. ``MlxWorkload`` is one; its module names the
backend (``MlxWorkload.backend()``), so the backend and the prober name the workload by this protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import Protocol

import mlx.nn as nn
import mlx.optimizers as optim


class MlxTrainable(Protocol):
    """An MLX model, its optimizer and one sample batch, and how one training step runs on a batch."""

    model: nn.Module
    optimizer: optim.Optimizer | None
    sample_batch: Any

    def bytes_per_sample(self) -> int: ...
    def train_step(self, batch: Any, mark: Callable[[str], None] = ...) -> None: ...
