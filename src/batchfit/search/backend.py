"""SearchBackend: what the search loop needs from one framework (torch here, MLX in its integration).

``search_workload`` runs the same loop for every framework; where frameworks differ (how a device
is named, what one sample costs, how a trial runs, which strategy ``"auto"`` means, whether a fake
trace can estimate the edge) it asks the workload's backend, a value declared by the workload
itself: torch's ``Workload`` uses ``TORCH``; any other workload declares ``backend()``.

>>> import torch
>>> from batchfit.step.workload import Workload
>>> work = Workload(torch.nn.Linear(4, 1), torch.zeros(8, 4), loss_fn=lambda out, batch: out.mean())
>>> backend = backend_for(work)
>>> backend.name, backend.bytes_per_sample(work), backend.auto_strategy(backend.resolve_device(work, "sim:1MiB"))
('torch', 16, 'auto')
"""

from __future__ import annotations

from typing import Any
from typing import Protocol
from typing import runtime_checkable

from batchfit.devices.base import Device
from batchfit.devices.resolve import resolve_device
from batchfit.devices.trace import TraceDevice
from batchfit.errors import InputTypeError
from batchfit.search.prober import Prober
from batchfit.search.strategies import Strategy
from batchfit.search.trial import Trial
from batchfit.step.batching import bytes_per_sample
from batchfit.step.compiled import CompileWatch
from batchfit.step.workload import Workload


class TrialProber(Protocol):
    """What runs the trials of one search: a context manager (state saved on entry, restored on
    exit) whose ``probe(batch_size, steps=None)`` returns a ``Trial`` (``steps``: full steps other than the
    search's, where the prober can run them: a confirmation at the answer). ``baseline_bytes`` is what the workload
    holds before any batch; ``compile_watch`` counts ``torch.compile`` graphs, or is ``None``."""

    baseline_bytes: int
    compile_watch: CompileWatch | None

    def __enter__(self) -> TrialProber: ...
    def __exit__(self, *exc_info: object) -> None: ...
    def probe(self, batch_size: int, steps: int | None = None) -> Trial: ...


class SearchBackend(Protocol):
    """One framework's side of a search; every method is pure (nothing it is given changes)."""

    name: str
    """The framework: ``"torch"``, ``"mlx"``."""

    def resolve_device(self, workload: Any, spec: Any) -> Device:
        """The device ``spec`` names for ``workload`` (``None``: the framework's default for it)."""
        ...

    def bytes_per_sample(self, workload: Any) -> int:
        """Bytes one sample of the batch takes: no batch larger than the free memory over this fits."""
        ...

    def prober(self, workload: Any, device: Device, *, steps: int, limit_bytes: int | None) -> TrialProber:
        """What runs the trials of ``workload`` (already ``device.prepare``d) on ``device``."""
        ...

    def auto_strategy(self, device: Device) -> str | Strategy:
        """What ``strategy="auto"`` runs on ``device``: the device's best default."""
        ...

    def is_trace(self, device: Device) -> bool:
        """True when ``device`` only estimates (fake tensors): its trials are logged quietly and never traced again."""
        ...

    def can_trace(self, workload: Any) -> bool:
        """True when a fake-tensor trace can estimate the edge of ``workload`` before real trials."""
        ...


@runtime_checkable
class DeclaresBackend(Protocol):
    """A workload of another framework: it names its own backend."""

    def backend(self) -> SearchBackend: ...


class TorchBackend:
    """torch's ``Workload`` on torch devices: ``Prober`` trials, and the trace device's estimate first."""

    name = "torch"

    def resolve_device(self, workload: Workload, spec: Any) -> Device:
        return resolve_device(spec, workload.model)

    def bytes_per_sample(self, workload: Workload) -> int:
        return bytes_per_sample(workload.sample_batch)

    def prober(self, workload: Workload, device: Device, *, steps: int, limit_bytes: int | None) -> Prober:
        return Prober(workload, device, steps=steps, limit_bytes=limit_bytes)

    def auto_strategy(self, device: Device) -> str:
        return "auto"  # a per-op timeline (or two points) lets the memory model aim at the edge

    def is_trace(self, device: Device) -> bool:
        return isinstance(device, TraceDevice)

    def can_trace(self, workload: Workload) -> bool:
        return True

    def __repr__(self) -> str:
        return "TorchBackend()"


TORCH = TorchBackend()


def backend_for(workload: Any) -> SearchBackend:
    """The backend that searches ``workload``: ``TORCH`` for a ``batchfit.Workload``, else the one
    the workload declares with ``backend()``."""
    if isinstance(workload, Workload):
        return TORCH
    if isinstance(workload, DeclaresBackend):
        return workload.backend()
    raise InputTypeError(
        f"cannot search a {type(workload).__name__}: give a batchfit.Workload, an MLX workload "
        "(batchfit.integrations.mlx.MlxWorkload), or an object with a backend() method"
    )
