"""The search loop reaches each framework through a declared SearchBackend: torch's, MLX's, or a workload's own."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import batchfit as bf
from batchfit.search.backend import TORCH
from batchfit.search.backend import backend_for
from batchfit.search.runner import probe_workload
from batchfit.search.trial import Trial
from models import CASES

EDGE = 37


@dataclass
class FormulaDevice:
    """A device of a framework batchfit does not know: nothing but a name and an unknown capacity."""

    name: str = "formula"

    def capacity_bytes(self) -> None:
        return None

    def prepare(self, workload):
        return workload


class FormulaProber:
    baseline_bytes = 0
    compile_watch = None

    def __enter__(self) -> FormulaProber:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def probe(self, batch_size: int) -> Trial:
        fits = batch_size <= EDGE
        return Trial(batch_size, fits, 10 * batch_size if fits else None, 0.0, None if fits else "oom", oom=not fits)


class FormulaBackend:
    name = "formula"

    def __init__(self):
        self.devices = []

    def resolve_device(self, workload, spec):
        self.devices.append(spec)
        return FormulaDevice()

    def bytes_per_sample(self, workload):
        return 10

    def prober(self, workload, device, *, steps, limit_bytes):
        return FormulaProber()

    def auto_strategy(self, device):
        return "binary"

    def is_trace(self, device):
        return False

    def can_trace(self, workload):
        return False


@dataclass
class FormulaWorkload:
    own: FormulaBackend
    name: str = "formula-workload"

    def backend(self) -> FormulaBackend:
        return self.own


def test_a_workload_that_declares_its_backend_is_searched_through_it():
    backend = FormulaBackend()
    result = bf.search_workload(FormulaWorkload(backend), device="anything", max_batch_size=64)
    assert backend.devices == ["anything"]
    assert result.batch_size == EDGE and result.exact and result.strategy == "binary"  # the backend's "auto"
    assert result.device == "formula" and result.workload == "formula-workload" and "trace" not in result.extra
    trial = probe_workload(FormulaWorkload(backend), 40)
    assert not trial.fits and trial.batch_size == 40


def test_torch_workloads_use_the_torch_backend_and_anything_else_is_one_clear_line():
    work = CASES[0].build()
    assert backend_for(work) is TORCH
    assert TORCH.auto_strategy(bf.SimulatedDevice("1MiB")) == "auto"
    assert TORCH.is_trace(bf.TraceDevice("1MiB")) and not TORCH.is_trace(bf.SimulatedDevice("1MiB"))
    assert TORCH.can_trace(work)
    with pytest.raises(TypeError, match="give a batchfit.Workload"):
        backend_for(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="cannot search a Linear"):
        bf.search_workload(torch.nn.Linear(2, 2), device="sim:1MiB")


def test_the_mlx_workload_declares_the_mlx_backend():
    pytest.importorskip("mlx.core")
    from batchfit.integrations.mlx.backend import MLX

    mlx_nn = pytest.importorskip("mlx.nn")
    import mlx.core as mx

    from batchfit.integrations.mlx import MlxDevice
    from batchfit.integrations.mlx import MlxWorkload

    work = MlxWorkload(mlx_nn.Linear(4, 1), mx.zeros((2, 4)), loss_fn=lambda out, batch: out.mean())
    assert backend_for(work) is MLX
    assert MLX.auto_strategy(MlxDevice("8MiB")) == "power" and not MLX.can_trace(work)
    assert MLX.bytes_per_sample(work) == 16
