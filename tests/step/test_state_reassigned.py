"""A module that reassigns a buffer or parameter in ``forward`` (``self.seen = self.seen + 1``)
gets the original tensor object back in its slot, with its original values, after a search, after
an OOM in a probe and after an error in forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf


class Counting(nn.Module):
    """Counts the batches it sees in a buffer by reassignment; optionally replaces a parameter too."""

    def __init__(self, *, replace_param: bool = False, fail: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.scale = nn.Parameter(torch.ones(4))
        self.replace_param = replace_param
        self.fail = fail
        self.reassigned = 0  # forwards that got past the reassignment (plain Python, not restored)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + 1
        if self.replace_param:
            self.scale = nn.Parameter(self.scale.detach() * 2)
        self.reassigned += 1
        if self.fail:
            raise RuntimeError("the user's bug, after the reassignment")
        return self.layer(inputs) * self.scale


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 8), torch.randint(0, 4, (2,))


def _slots(model: Counting) -> dict[str, torch.Tensor]:
    return {"seen": model.seen, "scale": model.scale, "weight": model.layer.weight}


def _assert_restored(model: Counting, before: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    for name, tensor in _slots(model).items():
        assert tensor is before[name], f"{name} is not the original object"
        assert torch.equal(tensor.detach(), values[name]), f"{name} changed value"
    assert dict(model.named_buffers()).keys() == {"seen"}
    assert dict(model.named_parameters())["scale"] is before["scale"]


def _probe_state(model: Counting) -> tuple[dict, dict]:
    before = _slots(model)
    return before, {name: tensor.detach().clone() for name, tensor in before.items()}


@pytest.mark.parametrize("replace_param", [False, True], ids=["buffer", "buffer+param"])
def test_a_search_puts_the_reassigned_tensors_back(replace_param):
    model = Counting(replace_param=replace_param)
    before, values = _probe_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = bf.find_max_batch_size(
        model, _batch(), loss_fn=F.cross_entropy, optimizer=optimizer, device="sim:64KiB", max_batch_size=64
    )
    assert result.batch_size >= 1
    _assert_restored(model, before, values)


@pytest.mark.parametrize("replace_param", [False, True], ids=["buffer", "buffer+param"])
def test_an_oom_in_a_probe_puts_the_reassigned_tensors_back(replace_param):
    model = Counting(replace_param=replace_param)
    before, values = _probe_state(model)
    device = bf.SimulatedDevice("8KiB")
    trial = bf.probe_batch_size(model, _batch(), 64, loss_fn=F.cross_entropy, device=device)
    assert trial.oom and not trial.fits and trial.failed_phase == "forward"
    assert model.reassigned == 1  # the OOM struck in forward, after the buffer was reassigned
    _assert_restored(model, before, values)


@pytest.mark.parametrize("replace_param", [False, True], ids=["buffer", "buffer+param"])
def test_an_error_in_forward_after_the_reassignment_propagates_and_restores(replace_param):
    model = Counting(replace_param=replace_param, fail=True)
    before, values = _probe_state(model)
    with pytest.raises(RuntimeError, match="the user's bug, after the reassignment"):
        bf.probe_batch_size(model, _batch(), 4, loss_fn=F.cross_entropy, device="sim:1MiB")
    _assert_restored(model, before, values)


def test_a_snapshot_restores_slots_directly():
    model = Counting(replace_param=True)
    before, values = _probe_state(model)
    snapshot = bf.StateSnapshot.take(model)
    model(torch.randn(2, 8))
    model(torch.randn(2, 8))
    with torch.no_grad():
        model.layer.weight.add_(1.0)
    model.register_buffer("extra", torch.ones(1))  # a slot the snapshot did not know
    snapshot.restore()
    assert "extra" not in dict(model.named_buffers())
    _assert_restored(model, before, values)
