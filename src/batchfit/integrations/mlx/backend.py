"""MlxBackend: how the search loop reaches MLX workloads and devices (``batchfit.search.backend.SearchBackend``)."""

from __future__ import annotations

from typing import Any

from batchfit.integrations.mlx.device import MlxDevice
from batchfit.integrations.mlx.device import resolve_mlx_device
from batchfit.integrations.mlx.probe import MlxProber
from batchfit.integrations.mlx.trainable import MlxTrainable


class MlxBackend:
    """MLX workloads on ``MlxDevice``: ``MlxProber`` trials, no fake-tensor trace, ``power`` for "auto".

    >>> MLX.auto_strategy(MlxDevice("64MiB")), MLX.is_trace(MlxDevice("64MiB"))
    ('power', False)
    """

    name = "mlx"

    def resolve_device(self, workload: MlxTrainable, spec: Any) -> MlxDevice:
        """The ``MlxDevice`` for ``spec`` (``None``/``"auto"``, ``"mlx"``, ``"mlx:8GiB"``, an ``MlxDevice``)."""
        return resolve_mlx_device(spec)

    def bytes_per_sample(self, workload: MlxTrainable) -> int:
        return workload.bytes_per_sample()

    def prober(self, workload: MlxTrainable, device: MlxDevice, *, steps: int, limit_bytes: int | None) -> MlxProber:
        return MlxProber(workload, device, steps=steps, limit_bytes=limit_bytes)

    def auto_strategy(self, device: MlxDevice) -> str:
        # A trial gives one peak (no per-op timeline), flat at small sizes where the optimizer's
        # temporaries dominate, so auto's line through two small trials misses the activations and
        # jumps far past the edge (measured: to 9191 for an edge of 691); doubling, then bisecting,
        # never goes past twice a size that fitted.
        return "power"

    def is_trace(self, device: MlxDevice) -> bool:
        return False  # every MLX device runs the step for real

    def can_trace(self, workload: MlxTrainable) -> bool:
        return False  # no fake-tensor estimate for MLX: the search probes from the start

    def __repr__(self) -> str:
        return "MlxBackend()"


MLX = MlxBackend()
