"""MLX: the same search, plan and report for Apple's MLX, on Apple silicon and on Linux.

An ``MlxWorkload`` (model, one sample batch, loss, optimizer) and an ``MlxDevice`` (capacity:
Metal's recommended working set on Apple silicon, else one you give) stand behind the same
protocols as torch's ``Workload`` and devices, so the strategies, ``SearchResult``, its JSON, the
planner and ``batchfit find`` work unchanged. ``pip install "batchfit[mlx]"``; ``import batchfit``
never imports MLX.

>>> import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
>>> import batchfit as bf
>>> from batchfit.integrations.mlx import find_max_batch_size
>>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
>>> sample = (mx.random.normal((8, 32)), mx.random.randint(0, 10, (8,)))
>>> result = find_max_batch_size(model, sample, loss_fn=lambda out, y: nn.losses.cross_entropy(out, y).mean(),
...                              optimizer=optim.AdamW(learning_rate=1e-3), device="mlx:4MiB")
>>> plan = bf.plan_batch(micro_batch_size=result.batch_size, global_batch_size=4 * result.batch_size)
>>> plan.gradient_accumulation_steps
4
"""

from batchfit.integrations.mlx import _available  # noqa: F401  (first: one clear line where MLX is missing)
from batchfit.integrations.mlx.api import find_max_batch_size
from batchfit.integrations.mlx.api import probe_batch_size
from batchfit.integrations.mlx.device import MLX_OOM_MESSAGES
from batchfit.integrations.mlx.device import MlxDevice
from batchfit.integrations.mlx.device import is_mlx_oom
from batchfit.integrations.mlx.device import resolve_mlx_device
from batchfit.integrations.mlx.probe import MlxProber
from batchfit.integrations.mlx.snapshot import MlxSnapshot
from batchfit.integrations.mlx.workload import MlxWorkload

__all__ = [
    "MLX_OOM_MESSAGES",
    "MlxDevice",
    "MlxProber",
    "MlxSnapshot",
    "MlxWorkload",
    "find_max_batch_size",
    "is_mlx_oom",
    "probe_batch_size",
    "resolve_mlx_device",
]
