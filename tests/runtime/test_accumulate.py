"""Gradient accumulation gives the full batch's gradient, also for uneven splits and under DDP."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from batchfit.runtime.accumulate import GradientAccumulator
from ddp_launch import ddp_output


def model_and_batch(samples: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()
    batch = (torch.randn(samples, 6, dtype=torch.float64), torch.randn(samples, 2, dtype=torch.float64))
    return model, batch


def full_batch_gradient(model, batch):
    model.zero_grad()
    F.mse_loss(model(batch[0]), batch[1]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("micro", [1, 3, 4, 7, 10, 16])
def test_accumulated_gradient_equals_the_full_batch_gradient(micro):
    model, batch = model_and_batch()
    expected = full_batch_gradient(model, batch)
    accumulator = GradientAccumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=micro, loss_fn=F.mse_loss
    )
    loss = accumulator.accumulate(batch)
    assert accumulator.micro_batches_last_step == -(-10 // micro)
    for grad, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-10)
    with torch.no_grad():
        assert loss == pytest.approx(float(F.mse_loss(model(batch[0]), batch[1])), abs=1e-10)


def test_one_optimizer_scheduler_and_ema_step_per_global_batch():
    model, batch = model_and_batch()
    twin, _ = model_and_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    ema = torch.optim.swa_utils.AveragedModel(model)
    accumulator = GradientAccumulator(
        model, optimizer, micro_batch_size=3, loss_fn=F.mse_loss, scheduler=scheduler, ema=ema
    )
    accumulator.step(batch)
    # the same update as one full-batch SGD step
    F.mse_loss(twin(batch[0]), batch[1]).backward()
    with torch.no_grad():
        for p in twin.parameters():
            p -= 0.5 * p.grad
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # the scheduler stepped once
    assert int(ema.n_averaged) == 1 and all(p.grad is None for p in model.parameters())


def test_weights_can_count_tokens_instead_of_samples():
    model, (inputs, targets) = model_and_batch()
    batch = {"x": inputs, "y": targets, "tokens": torch.arange(1, 11)}  # sample i carries i tokens

    def step(m, b):  # the token-weighted mean loss
        per_sample = F.mse_loss(m(b["x"]), b["y"], reduction="none").mean(1)
        return (per_sample * b["tokens"]).sum() / b["tokens"].sum()

    expected_model, _ = model_and_batch()
    step(expected_model, batch).backward()
    accumulator = GradientAccumulator(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        micro_batch_size=4,
        step_fn=step,
        sample_weight=lambda b: int(b["tokens"].sum()),
    )
    accumulator.accumulate(batch)
    for mine, want in zip(model.parameters(), expected_model.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, want.grad, rtol=0, atol=1e-10)


def test_bad_micro_batch_size():
    model, _ = model_and_batch()
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer, got 0"):
        GradientAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=0)


@pytest.mark.slow  # the shared torchrun launch: make reliability runs it
def test_under_ddp_with_two_gloo_ranks_the_gradient_is_the_full_batch_gradient(tmp_path_factory):
    out = ddp_output("ddp_accumulation", tmp_path_factory) / "out"  # the launch ddp_suite.py shares
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["micro_batches"] == 3
    assert result["difference"] < 1e-10
