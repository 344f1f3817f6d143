"""Bad inputs fail at once with one clear line that names the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf


def model_and_batch():
    model = nn.Linear(4, 2)
    return model, (torch.randn(3, 4), torch.tensor([0, 1, 1]))


def find(**overrides):
    model, batch = model_and_batch()
    kwargs = {"loss_fn": F.cross_entropy, "device": "sim:1MiB", **overrides}
    return bf.find_max_batch_size(kwargs.pop("model", model), kwargs.pop("batch", batch), **kwargs)


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"min_batch_size": 0}, ValueError, "min_batch_size must be an integer of at least 1, got 0"),
        (
            {"min_batch_size": 8, "max_batch_size": 4},
            ValueError,
            r"max_batch_size must be an integer >= min_batch_size \(8\)",
        ),
        ({"batch": {"text": "hello"}}, ValueError, "holds no tensor with a batch dimension"),
        ({"batch": (torch.randn(3, 4), torch.tensor([0, 1]))}, ValueError, r"different batch lengths \[2, 3\]"),
        ({"strategy": "fastest"}, ValueError, "unknown strategy 'fastest': choose one of auto, binary"),
        ({"device": "sim:1KiB"}, ValueError, "already holds .* before any batch.*larger capacity"),
        ({"device": "sim:lots"}, ValueError, "not a size: write it like '512MiB'"),
        ({"device": "quantum"}, ValueError, "unknown device 'quantum'"),
        ({"device": 3}, TypeError, "device must be a string, a torch.device or a batchfit Device"),
        ({"margin": 1.5}, ValueError, r"fractional margin must be in \[0, 1\)"),
        ({"margin": "a bit"}, ValueError, "margin 'a bit' is not a size"),
        ({"max_trials": 0}, ValueError, "max_trials must be an integer of at least 1"),
        ({"amp_dtype": "fp8"}, ValueError, "amp_dtype must be torch.float16, torch.bfloat16"),
        ({"mode": "infer"}, ValueError, "mode must be one of"),
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"model": "not a model"}, TypeError, "model must be a torch.nn.Module"),
    ],
)
def test_bad_arguments_name_the_fix(overrides, error, message):
    with pytest.raises(error, match=message):
        find(**overrides)


def test_a_model_with_nothing_to_train():
    model = nn.Linear(4, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad.*mode='eval'"):
        find(model=model)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        find(model=nn.Identity())


def test_a_loss_that_is_not_a_scalar():
    with pytest.raises(ValueError, match=r"loss must be a scalar, got shape \(1, 2\).*\.mean\(\)"):
        find(loss_fn=lambda output, targets: output[:1])
    with pytest.raises(TypeError, match="loss must be a tensor, got float"):
        find(loss_fn=lambda output, targets: 1.0)


def test_an_optimizer_over_another_models_parameters():
    other = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="2 parameter.*not the model's.*model.parameters"):
        find(optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_batch_that_needs_a_loss():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="needs a loss: pass loss_fn"):
        bf.find_max_batch_size(model, torch.randn(3, 4), device="sim:1MiB")
    with pytest.raises(ValueError, match=r"no \.loss: pass loss_fn"):
        bf.find_max_batch_size(model, {"input": torch.randn(3, 4)}, device="sim:1MiB")


def test_probe_batch_size_rejects_sizes_below_one():
    model, batch = model_and_batch()
    with pytest.raises(ValueError, match="batch_size must be an integer of at least 1, got 0"):
        bf.probe_batch_size(model, batch, 0, loss_fn=F.cross_entropy, device="sim:1MiB")


def test_a_bad_loss_leaves_the_model_untouched():
    model, batch = model_and_batch()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError):
        bf.find_max_batch_size(model, batch, loss_fn=lambda o, t: o, device="sim:1MiB")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("device", ["cuda", "sim:lots", "a200-40gb", 0, torch.device("cpu"), bf.CpuDevice()])
def test_estimate_memory_names_the_devices_it_takes(device):
    model, batch = model_and_batch()
    with pytest.raises(ValueError, match=r"^an estimate cannot run on device .*give a TraceDevice.*'a100-40gb'"):
        bf.estimate_memory(model, batch, 8, loss_fn=F.cross_entropy, device=device)
