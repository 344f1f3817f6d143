"""An estimate works on a model wherever it lives (a GPU, ``meta``), and leaves it as it was: never moved, no
weak reference left on its tensors (torch refuses to swap a parameter one points at), bitwise unchanged also
when the trace fails."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from torch import nn

import batchfit as bf
from batchfit.errors import TraceError


def model_and_batch(device: str = "cpu") -> tuple[nn.Module, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4)).to(device)
    return model, torch.randint(0, 100, (4, 8)), torch.optim.AdamW(model.parameters())


def loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@contextlib.contextmanager
def swapping_on_conversion():
    """torch's future behaviour: ``Module.to`` swaps every parameter (``torch.utils.swap_tensors``)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("swap", [False, True])
def test_a_model_on_meta_estimates_as_the_same_model_on_the_cpu(swap):
    """A model that lives elsewhere (a GPU; here ``meta``) is copied onto the trace's device from a description
    of its tensors, never moved: it used to fail in ``_apply(): Couldn't swap Embedding.weight``."""
    with swapping_on_conversion() if swap else contextlib.nullcontext():
        estimates = [
            bf.estimate_memory(model, batch, 64, loss_fn=loss, optimizer=optimizer, device="a100-40gb")
            for model, batch, optimizer in (model_and_batch("cpu"), model_and_batch("meta"))
        ]
    assert estimates[0].peak_bytes == estimates[1].peak_bytes and estimates[0].breakdown == estimates[1].breakdown


def test_an_estimate_leaves_no_weak_reference_and_the_model_can_still_be_swapped():
    model, batch, optimizer = model_and_batch()
    bf.estimate_memory(model, batch, 8, loss_fn=loss, optimizer=optimizer, device="a100-40gb")
    assert not any(weakref.getweakrefcount(p) for p in model.parameters())
    assert weakref.getweakrefcount(batch) == 0
    with swapping_on_conversion():
        model.to(torch.float64)  # torch.utils.swap_tensors refuses a parameter with a weak reference
    assert all(p.dtype == torch.float64 for p in model.parameters())


class ValueQuestion(nn.Module):
    """Asks its parameters a question about their values: fake tensors cannot answer it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[(self.linear(x) > self.linear.weight.mean()).any(dim=1)]  # how many: the parameters' values
        return self.linear(rows).sum() + self.seen


def test_a_failed_estimate_leaves_the_model_and_optimizer_bitwise_as_they_were():
    torch.manual_seed(0)
    model = ValueQuestion()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).backward()
    optimizer.step()  # optimizer state and gradients exist
    before = bf.StateSnapshot.take(model, optimizer)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with pytest.raises(TraceError, match="cannot trace this workload"):
        bf.estimate_memory(
            model, torch.randn(4, 8), 16, loss_fn=lambda out, batch: out, optimizer=optimizer, device="a100-40gb"
        )
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, optimizer.state.values(), strict=True))
    assert not any(weakref.getweakrefcount(p) for p in model.parameters())
    before.restore()
