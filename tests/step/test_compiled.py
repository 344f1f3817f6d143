"""A torch.compile'd model on the simulated device: the eager answer, and the model still compiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.cuda import CudaDevice
from fake_cuda import FakeCuda


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo keeps graphs per code object: each test starts with none."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(torch.nn.Module):
    """Its own forward code, so no other test's compiled Sequential shares dynamo's per-code state."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_a_compiled_model_is_probed_eagerly_and_left_compilable():
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(4, 32), torch.randint(0, 4, (4,)))
    eager = bf.find_max_batch_size(
        model, batch, loss_fn=F.cross_entropy, optimizer=torch.optim.Adam(model.parameters()), device="sim:256KiB"
    )
    compiled = torch.compile(model, backend="eager")
    found = bf.find_max_batch_size(
        compiled, batch, loss_fn=F.cross_entropy, optimizer=torch.optim.Adam(compiled.parameters()), device="sim:256KiB"
    )
    assert found.batch_size == eager.batch_size and found.exact
    counters.clear()
    compiled(torch.randn(5, 32))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo still compiles the user's model afterwards


def test_timing_a_compiled_model_leaves_it_compilable_too():
    torch.manual_seed(0)
    compiled = torch.compile(Net(), backend="eager")
    batch = (torch.randn(4, 32), torch.randint(0, 4, (4,)))
    result = bf.find_optimal_batch_size(
        compiled,
        batch,
        loss_fn=F.cross_entropy,
        optimizer=torch.optim.Adam(compiled.parameters()),
        device="sim:256KiB",
        max_batch_size=8,
        timed_steps=1,
    )
    assert 1 <= result.batch_size <= 8
    counters.clear()
    compiled(torch.randn(5, 32))
    assert counters["stats"]["unique_graphs"] >= 1


class AllocatorDevice(CudaDevice):
    """CudaDevice's own code on the CPU, its allocator statistics from FakeCuda: a device that reads an
    allocator instead of counting through a dispatch mode, so the compiled model itself is probed."""

    def __init__(self):
        super().__init__(0)
        self.torch_device = torch.device("cpu")


EDGE = 23  # the fake GPU's allocator fails past this many rows


def out_of_memory_past_the_edge(output, target):
    if output.shape[0] > EDGE:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
    return F.cross_entropy(output, target)


def search_compiled(monkeypatch, model, **options):
    FakeCuda().patch(monkeypatch)
    batch = (torch.randn(4, 32), torch.randint(0, 4, (4,)))
    return bf.find_max_batch_size(
        model,
        batch,
        loss_fn=out_of_memory_past_the_edge,
        strategy="binary",
        optimizer=torch.optim.Adam(model.parameters()),
        device=AllocatorDevice(),
        max_batch_size=64,
        **options,
    )


@pytest.mark.parametrize("dynamic", [None, False])
def test_a_compiled_model_is_probed_compiled_with_one_graph_for_every_size(monkeypatch, dynamic):
    torch.manual_seed(0)
    compiled = torch.compile(Net(), backend="aot_eager", dynamic=dynamic)
    result = search_compiled(monkeypatch, compiled)
    # the classic bisection; then, a CUDA device's caching allocator deciding what fits, the answer for 4 steps
    assert [t.batch_size for t in result.trials] == [32, 16, 24, 20, 22, 23, 23]
    assert [t.steps for t in result.trials[-2:]] == [2, 4] and result.extra["confirmed"]["batch_size"] == EDGE
    assert result.batch_size == EDGE and result.exact
    assert result.extra["compile"] == {"graphs": 1, "recompiles": 0, "sizes": 6}


def test_without_marking_the_batch_dynamic_sizes_recompile(monkeypatch):
    monkeypatch.setattr("batchfit.search.prober.mark_batch_dynamic", lambda batch: None)
    compiled = torch.compile(Net(), backend="aot_eager", dynamic=False)
    result = search_compiled(monkeypatch, compiled)
    assert result.extra["compile"]["recompiles"] == 5  # one graph per size: what the marking saves


class SpecializingNet(Net):
    def forward(self, x):
        rows = [x[index] for index in range(x.shape[0])]  # a Python loop over the batch: unrolled per size
        return super().forward(torch.stack(rows))


def test_a_model_that_specializes_on_the_size_is_reported_with_a_warning(monkeypatch, caplog):
    compiled = torch.compile(SpecializingNet(), backend="aot_eager")
    with caplog.at_level("WARNING", logger="batchfit"):
        result = search_compiled(monkeypatch, compiled)
    assert result.batch_size == EDGE
    assert result.extra["compile"]["recompiles"] >= 2
    assert "torch.compile recompiled" in caplog.text and "specializes" in caplog.text and "batch sizes" in caplog.text


def test_the_microbatcher_trains_a_compiled_model_on_the_simulated_device_and_leaves_it_compilable():
    torch.manual_seed(0)
    model = Net()
    compiled = torch.compile(model, backend="eager")
    batcher = bf.Microbatcher(
        compiled,
        torch.optim.SGD(compiled.parameters(), lr=0.1),
        loss_fn=F.cross_entropy,
        device=bf.SimulatedDevice("256KiB"),
        micro_batch_size=512,
    )
    batch = (torch.randn(512, 32), torch.randint(0, 4, (512,)))
    before = model.first.weight.clone()
    batcher.step(batch)
    assert batcher.history[-1].ooms >= 1 and batcher.current_micro_batch_size < 512  # it shrank under the capacity
    assert not torch.equal(before, model.first.weight)  # and the step updated the shared parameters
    counters.clear()
    compiled(torch.randn(5, 32))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo still compiles the user's model afterwards
