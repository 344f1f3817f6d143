"""Calling conventions, eval mode, AMP and optimizer factories."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.step.batching import resize_batch
from batchfit.step.builtin_workloads import MLPClassifier

SIM = "sim:4MiB"


class Recorder(nn.Module):
    """Records how it was called."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.calls = []

    def forward(self, *args, **kwargs):
        self.calls.append((len(args), sorted(kwargs)))
        inputs = args[0] if args else kwargs["x"]
        if isinstance(inputs, dict):
            inputs = inputs["x"]
        return self.linear(inputs)


def test_inputs_targets_pair_runs_loss_fn_on_output_and_targets():
    model = Recorder()
    seen = []

    def loss_fn(output, targets):
        seen.append((tuple(output.shape), tuple(targets.shape)))
        return F.cross_entropy(output, targets)

    trial = bf.probe_batch_size(model, (torch.randn(2, 4), torch.tensor([0, 2])), 5, loss_fn=loss_fn, device=SIM)
    assert trial.fits and trial.steps == 2
    assert model.calls == [(1, []), (1, [])]
    assert seen == [((5, 3), (5,)), ((5, 3), (5,))]


def test_mapping_runs_model_with_keywords_and_uses_output_loss():
    model = MLPClassifier(features=4, hidden=8, classes=3)
    batch = {"features": torch.randn(2, 4), "labels": torch.tensor([0, 1])}
    trial = bf.probe_batch_size(model, batch, 6, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device=SIM)
    assert trial.fits and set(trial.phase_peak_bytes) == {"forward", "backward", "optimizer"}


def test_mapping_with_loss_fn_gets_output_and_the_whole_batch():
    model = Recorder()
    seen = []

    def loss_fn(output, batch):
        seen.append(sorted(batch))
        return output.sum()

    bf.probe_batch_size(model, {"x": torch.randn(2, 4), "id": torch.arange(2)}, 3, loss_fn=loss_fn, device=SIM)
    assert model.calls[0] == (0, ["id", "x"])
    assert seen[0] == ["id", "x"]


def test_anything_else_runs_model_on_the_batch_and_loss_fn_on_output_and_batch():
    model = Recorder()
    seen = []

    def loss_fn(output, batch):
        seen.append(type(batch).__name__)
        return output.sum()

    bf.probe_batch_size(model, torch.randn(2, 4), 3, loss_fn=loss_fn, device=SIM)
    assert model.calls[0] == (1, []) and seen[0] == "Tensor"


def test_step_fn_overrides_the_convention():
    model = Recorder()

    def step_fn(model, batch):
        return model(batch["x"]).pow(2).mean()

    trial = bf.probe_batch_size(model, {"x": torch.randn(2, 4)}, 3, step_fn=step_fn, device=SIM)
    assert trial.fits and model.calls[0] == (1, [])


def test_eval_mode_runs_forward_without_grad_and_in_eval():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    states = []
    model.register_forward_hook(lambda module, args, out: states.append((module.training, out.requires_grad)))
    trial = bf.probe_batch_size(model, torch.randn(2, 4), 3, mode="eval", device=SIM)
    assert trial.fits and set(trial.phase_peak_bytes) == {"forward"}
    assert states == [(False, False), (False, False)]
    assert model.training  # put back afterwards


def test_bf16_autocast_lowers_the_activation_peak():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    batch = (torch.randn(2, 256), torch.randn(2, 256))
    # at 1024 rows activations dominate (at 64, parameters and autocast's weight copies do)
    fp32 = bf.probe_batch_size(model, batch, 1024, loss_fn=F.mse_loss, device="sim:256MiB")
    bf16 = bf.probe_batch_size(model, batch, 1024, loss_fn=F.mse_loss, amp_dtype="bf16", device="sim:256MiB")
    assert bf16.phase_peak_bytes["forward"] < fp32.phase_peak_bytes["forward"]
    assert bf16.phase_peak_bytes["backward"] < 0.8 * fp32.phase_peak_bytes["backward"]


def test_fp16_trains_with_a_grad_scaler_and_restores_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    work = bf.Workload(model, (torch.randn(2, 16), torch.tensor([0, 3])), F.cross_entropy, optimizer, torch.float16)
    assert work.make_scaler("cpu") is not None
    result = bf.search_workload(work, device="sim:1MiB", max_batch_size=64)
    assert result.batch_size == 64
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.state


def test_optimizer_factory_is_built_from_the_models_parameters():
    model = nn.Linear(4, 2)
    work = bf.Workload(model, torch.randn(2, 4), lambda out, batch: out.sum(), lambda params: torch.optim.Adam(params))
    assert isinstance(work.optimizer, torch.optim.Adam)
    assert {id(p) for g in work.optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_a_workload_holds_only_its_declared_fields():
    model = nn.Linear(4, 2)
    work = bf.Workload(model, torch.randn(2, 4), lambda out, batch: out.sum(), amp_dtype="bf16")
    assert set(vars(work)) == {field.name for field in dataclasses.fields(work)}
    work.sample_batch = resize_batch(work.sample_batch, 5)  # derived, so never stale
    assert work.sample_length == 5


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(bf.Workload))
    body = tree.body[0].body
    fields = [node.target.id for node in body if isinstance(node, ast.AnnAssign)]
    documented = [
        node.target.id
        for node, after in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
    ]
    assert fields == documented == [field.name for field in dataclasses.fields(bf.Workload)]


def test_construction_converts_only_what_it_documents():
    model = nn.Linear(4, 2)
    calls = []

    def factory(params):
        calls.append(1)
        return torch.optim.SGD(params, lr=0.1)

    loss_fn, batch = (lambda out, batch: out.sum()), torch.randn(2, 4)
    work = bf.Workload(model, batch, loss_fn, factory, "fp16", mode="train")
    assert work.amp_dtype is torch.float16 and work.name == "Linear" and isinstance(work.optimizer, torch.optim.SGD)
    assert work.model is model and work.sample_batch is batch and work.loss_fn is loss_fn
    again = dataclasses.replace(work, accumulating=True)  # the conversions are idempotent
    assert again.optimizer is work.optimizer and again.amp_dtype is torch.float16 and calls == [1]
