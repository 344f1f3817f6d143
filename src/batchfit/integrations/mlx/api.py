"""find_max_batch_size and probe_batch_size for MLX: the torch search, strategies and result, unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn

from batchfit.integrations.mlx.device import MlxDevice
from batchfit.integrations.mlx.workload import LossFn
from batchfit.integrations.mlx.workload import MlxWorkload
from batchfit.integrations.mlx.workload import StepFn
from batchfit.search.result import SearchResult
from batchfit.search.runner import probe_workload
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import Strategy
from batchfit.search.trial import Trial


def find_max_batch_size(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: Any = None,
    step_fn: StepFn | None = None,
    device: MlxDevice | str | None = None,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    strategy: str | Strategy = "auto",
    margin: int | float | str = 0,
    max_trials: int | None = None,
    steps: int = 2,
    on_trial: Callable[[Trial], None] | None = None,
) -> SearchResult:
    """The largest batch size of an MLX model that really fits: every answer is a size a trial ran.

    As ``batchfit.find_max_batch_size``: each trial runs ``steps`` (at least 2) full steps
    (``nn.value_and_grad``, ``optimizer.update``, ``mx.eval``) on a batch built from ``sample_batch``
    and restores the parameters, the optimizer state and the RNG key bitwise. ``device=None`` uses
    Metal's recommended working set on Apple silicon; elsewhere give a capacity (``"mlx:8GiB"`` or
    ``MlxDevice("8GiB")``). Use ``strategy="auto"`` (the default) or a ``max_batch_size``: MLX on the
    CPU cannot report an allocation failure, so a first trial far past the edge could exhaust the machine.

    >>> import mlx.core as mx, mlx.optimizers as optim
    >>> model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    >>> batch = (mx.zeros((4, 16)), mx.zeros((4,), dtype=mx.int32))
    >>> result = find_max_batch_size(model, batch, loss_fn=lambda out, y: nn.losses.cross_entropy(out, y).mean(),
    ...                              optimizer=optim.Adam(learning_rate=1e-3), device="mlx:2MiB")
    >>> result.exact and result.batch_size > 0
    True
    """
    settings = SearchSettings(
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        strategy=strategy,
        margin=margin,
        max_trials=max_trials,
        steps=steps,
    )
    workload = MlxWorkload(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, step_fn=step_fn)
    return search_workload(workload, settings, device=device, on_trial=on_trial)


def probe_batch_size(
    model: nn.Module,
    sample_batch: Any,
    batch_size: int,
    *,
    loss_fn: LossFn | None = None,
    optimizer: Any = None,
    step_fn: StepFn | None = None,
    device: MlxDevice | str | None = None,
    margin: int | float | str = 0,
    steps: int = 2,
) -> Trial:
    """Run one trial of an MLX model at ``batch_size`` and return it; state is restored afterwards.

    >>> import mlx.core as mx
    >>> trial = probe_batch_size(nn.Linear(8, 1), mx.zeros((2, 8)), 16, loss_fn=lambda out, batch: out.mean(),
    ...                          device="mlx:1MiB")
    >>> trial.fits, trial.steps
    (True, 2)
    """
    settings = SearchSettings(margin=margin, steps=steps)
    workload = MlxWorkload(model, sample_batch, loss_fn=loss_fn, optimizer=optimizer, step_fn=step_fn)
    return probe_workload(workload, batch_size, settings, device=device)
