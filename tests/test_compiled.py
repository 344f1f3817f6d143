"""A torch.compile'd model on the simulated device: the eager answer, and the model still compiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn import functional as F

import batchfit as bf


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
    eager = bf.find_max_batch_size(model, batch, loss_fn=F.cross_entropy, optimizer=torch.optim.Adam(model.parameters()),
                                   device="sim:256KiB")  # fmt: skip
    compiled = torch.compile(model, backend="eager")
    found = bf.find_max_batch_size(compiled, batch, loss_fn=F.cross_entropy,
                                   optimizer=torch.optim.Adam(compiled.parameters()), device="sim:256KiB")  # fmt: skip
    assert found.batch_size == eager.batch_size and found.exact
    counters.clear()
    compiled(torch.randn(5, 32))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo still compiles the user's model afterwards


def test_timing_a_compiled_model_leaves_it_compilable_too():
    torch.manual_seed(0)
    compiled = torch.compile(Net(), backend="eager")
    batch = (torch.randn(4, 32), torch.randint(0, 4, (4,)))
    result = bf.find_optimal_batch_size(compiled, batch, loss_fn=F.cross_entropy,
                                        optimizer=torch.optim.Adam(compiled.parameters()), device="sim:256KiB",
                                        max_batch_size=8, timed_steps=1)  # fmt: skip
    assert 1 <= result.batch_size <= 8
    counters.clear()
    compiled(torch.randn(5, 32))
    assert counters["stats"]["unique_graphs"] >= 1
