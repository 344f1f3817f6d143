"""The Microbatcher keeps training alive with exact gradients; the evaluator shrinks on its own."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import pytest
import torch
from torch.nn import functional as F

import batchfit as bf
from batchfit.runtime import microbatch
from batchfit.runtime.evaluation import EvalMicrobatcher
from batchfit.runtime.microbatch import Microbatcher
from batchfit.runtime.microbatch import StepRecord
from batchfit.step.builtin_workloads import gpt_tiny

GLOBAL = 64


def model_and_batch(samples: int = GLOBAL):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4)).double()
    batch = (torch.randn(samples, 32, dtype=torch.float64), torch.randn(samples, 4, dtype=torch.float64))
    return model, batch


def make_optimizer(kind: str, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def reference_step(kind: str, steps: int = 2, samples: int = GLOBAL):
    model, batch = model_and_batch(samples)
    optimizer = make_optimizer(kind, model)
    for _ in range(steps):
        optimizer.zero_grad()
        F.mse_loss(model(batch[0]), batch[1]).backward()
        optimizer.step()
    return model, optimizer


def transient_bytes(model, optimizer, batch, micro: int, loss_fn=F.mse_loss) -> int:
    """Bytes a second Microbatcher step at ``micro`` needs beyond what is live between steps."""
    model, optimizer = copy.deepcopy((model, optimizer))
    device = bf.SimulatedDevice("1GiB")
    batcher = Microbatcher(model, optimizer, loss_fn=loss_fn, device=device, micro_batch_size=micro, grow_after=None)
    batcher.step(batch)
    live = device.live_bytes()
    device.reset_peak()
    batcher.step(batch)
    return device.peak_bytes() - live


def step_peak(kind: str, micro: int) -> int:
    """The peak of two Microbatcher steps at ``micro`` on a device with room to spare."""
    model, batch = model_and_batch()
    device = bf.SimulatedDevice("1GiB")
    batcher = Microbatcher(
        model,
        make_optimizer(kind, model),
        loss_fn=F.mse_loss,
        device=device,
        micro_batch_size=micro,
        guard_optimizer_step=False,
    )
    device.reset_peak()
    for _ in range(2):
        batcher.step(batch)
    return device.peak_bytes()


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize(
    ("samples", "start", "sizes"), [(64, 64, [64, 32, 16]), (60, 16, [16])], ids=["shrink-64-to-16", "uneven-60-by-16"]
)
def test_shrinking_and_replaying_gives_the_full_batch_step_exactly(kind, samples, start, sizes):
    capacity = (step_peak(kind, 16) + step_peak(kind, 32)) // 2  # micro-batch 16 fits, 32 does not
    model, batch = model_and_batch(samples)
    optimizer = make_optimizer(kind, model)
    batcher = Microbatcher(
        model, optimizer, loss_fn=F.mse_loss, device=bf.SimulatedDevice(capacity), micro_batch_size=start
    )
    for _ in range(2):
        batcher.step(batch)
    expected, expected_optimizer = reference_step(kind, samples=samples)
    for mine, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    # 32 may still fit in step 1 (no optimizer state yet during backward) and fail in step 2
    assert sum(record.ooms for record in batcher.history) == len(sizes) - 1
    assert batcher.history[-1].micro_batch_size == 16 and batcher.history[-1].micro_batches == -(-samples // 16)
    assert all(record.samples == samples for record in batcher.history)
    if kind == "adamw":  # the optimizer stepped exactly once per global batch
        steps = {int(state["step"]) for state in optimizer.state.values()}
        assert steps == {2} == {int(state["step"]) for state in expected_optimizer.state.values()}


def wide_model_and_batch():
    """Many equal layers and small activations: AdamW's foreach temporaries (over all parameters at
    once) set the peak, while per-parameter ones stay small."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]).double()
    return model, (torch.randn(4, 64, dtype=torch.float64), torch.randn(4, 64, dtype=torch.float64))


def test_an_oom_in_the_optimizer_step_is_undone_and_run_per_parameter(caplog):
    def peak(foreach: bool) -> int:
        model, batch = wide_model_and_batch()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        device = bf.SimulatedDevice("1GiB")
        batcher = Microbatcher(
            model, optimizer, loss_fn=F.mse_loss, device=device, micro_batch_size=4, guard_optimizer_step=False
        )
        for _ in range(2):
            batcher.step(batch)
        return device.peak_bytes()

    foreach, single = peak(True), peak(False)
    assert foreach > single  # AdamW's foreach temporaries set the peak; per parameter they are smaller
    capacity = (foreach + single) // 2
    other, batch = wide_model_and_batch()
    unguarded = Microbatcher(
        other,
        torch.optim.AdamW(other.parameters(), lr=1e-3, foreach=True),
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice(capacity),
        micro_batch_size=4,
    )
    with pytest.raises(RuntimeError, match="may have updated some parameters already: use .*guard_optimizer_step=True"):
        for _ in range(2):
            unguarded.step(batch)

    model, batch = wide_model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # on CPU the default is per parameter
    batcher = Microbatcher(
        model,
        optimizer,
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice(capacity),
        micro_batch_size=4,
        guard_optimizer_step=True,
    )
    with caplog.at_level("WARNING", logger="batchfit"):
        for _ in range(2):
            batcher.step(batch)
    assert "the optimizer step ran out of memory; it ran again per parameter (foreach=False)" in caplog.text
    expected, (inputs, targets) = wide_model_and_batch()
    reference = make_optimizer("adamw", expected)
    for _ in range(2):
        reference.zero_grad()
        F.mse_loss(expected(inputs), targets).backward()
        reference.step()
    for mine, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    assert {int(state["step"]) for state in optimizer.state.values()} == {2}
    assert optimizer.param_groups[0]["foreach"] is True  # put back after the retry


def narrow_then_wide_model_and_batch():
    """Six parameters, the fifth (the last weight) far wider than the others: taken per parameter,
    AdamW's temporaries for it set the optimizer step's peak."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 256)
    ).double()
    return model, (torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 256, dtype=torch.float64))


WIDE_WEIGHT_BYTES = 256 * 8 * 8


def before_optimizer_step(optimizer, scaler, index: int, action) -> None:
    """Run ``action()`` once, as optimizer step ``index`` (from 0) begins: before the scaler unscales the
    gradients in place, where there is one. A retry of the same step does not run it again."""
    calls = itertools.count()

    def hook(*args, **kwargs):
        if next(calls) == index:
            action()

    if scaler is None:
        optimizer.register_step_pre_hook(hook)
        return
    step = scaler.step
    scaler.step = lambda *args, **kwargs: hook() or step(*args, **kwargs)


def make_scaler(scaled: bool):
    return torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None


def optimizer_step_bytes(index: int, scaled: bool) -> int:
    """Bytes optimizer step ``index``, taken per parameter, needs beyond what is live as it begins."""
    model, batch = narrow_then_wide_model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    scaler = make_scaler(scaled)
    device = bf.SimulatedDevice("1GiB")
    live = []
    before_optimizer_step(optimizer, scaler, index, lambda: live.append(device.live_bytes()) or device.reset_peak())
    batcher = Microbatcher(model, optimizer, loss_fn=F.mse_loss, device=device, micro_batch_size=8, scaler=scaler)
    for _ in range(index + 1):
        batcher.step(batch)
    return device.peak_bytes() - live[0]


def copied_state(model, optimizer) -> tuple:
    """Copies of what an optimizer step may change: parameters, gradients, optimizer state (by parameter
    index), and each group's settings."""
    params = list(model.parameters())
    state = {
        index: {key: value.clone() if torch.is_tensor(value) else value for key, value in optimizer.state[p].items()}
        for index, p in enumerate(params)
        if p in optimizer.state
    }
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return [p.detach().clone() for p in params], [p.grad.clone() for p in params], state, groups


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad-scaler"])
@pytest.mark.parametrize("index", [0, 1], ids=["first-step", "second-step"])
def test_an_optimizer_step_out_of_memory_per_parameter_too_leaves_nothing_half_applied(index, scaled, caplog):
    # The capacity drops as the optimizer step begins: room for every parameter's per-parameter AdamW
    # temporaries but the wide weight's. The foreach step runs out of memory with every parameter decayed and
    # its `step` counted; its per-parameter retry with four of the six parameters updated and the fifth (the
    # wide weight) decayed, its moments and `step` too.
    room = optimizer_step_bytes(index, scaled) - WIDE_WEIGHT_BYTES
    model, batch = narrow_then_wide_model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scaler = make_scaler(scaled)
    device = bf.SimulatedDevice("1GiB")
    before = []

    def drop_capacity():
        before.append(copied_state(model, optimizer))  # the copies are live on the device too
        device.counter.limit_bytes = device.live_bytes() + room

    before_optimizer_step(optimizer, scaler, index, drop_capacity)
    batcher = Microbatcher(
        model,
        optimizer,
        loss_fn=F.mse_loss,
        device=device,
        micro_batch_size=8,
        scaler=scaler,
        guard_optimizer_step=True,
    )
    for _ in range(index):
        batcher.step(batch)
    with caplog.at_level("WARNING", logger="batchfit"), pytest.raises(torch.OutOfMemoryError, match="sim:"):
        batcher.step(batch)
    ((params, grads, state, groups),) = before
    now_params, now_grads, now_state, now_groups = copied_state(model, optimizer)
    torch.testing.assert_close(now_params, params, rtol=0, atol=0)  # bitwise, dtype included
    torch.testing.assert_close(now_grads, grads, rtol=0, atol=0)  # still scaled, under a GradScaler
    torch.testing.assert_close(now_state, state, rtol=0, atol=0)  # `step` included; none made in step 0
    assert len(state) == 6 * index and now_groups == groups and groups[0]["foreach"] is True
    assert "its per-parameter retry raised OutOfMemoryError: the step is undone" in caplog.text
    assert len(batcher.history) == index  # the failed step is not recorded


def test_any_error_inside_a_guarded_optimizer_step_leaves_it_undone():
    model, batch = model_and_batch()
    optimizer = make_optimizer("adamw", model)
    before = []
    before_optimizer_step(optimizer, None, 1, lambda: before.append(copied_state(model, optimizer)))
    steps = itertools.count()

    def fail_after_the_second_step(*args):
        if next(steps) == 1:
            raise ValueError("a post-step hook failed")

    optimizer.register_step_post_hook(fail_after_the_second_step)  # every parameter is updated by then
    batcher = Microbatcher(model, optimizer, loss_fn=F.mse_loss, micro_batch_size=16, guard_optimizer_step=True)
    batcher.step(batch)
    with pytest.raises(ValueError, match="a post-step hook failed"):
        batcher.step(batch)
    ((params, grads, state, _),) = before
    torch.testing.assert_close(copied_state(model, optimizer)[:3], (params, grads, state), rtol=0, atol=0)
    assert {int(entries["step"]) for entries in optimizer.state.values()} == {1}


class SampleCounter(torch.nn.Module):
    """Counts the samples its forward sees in a buffer it reassigns (``self.seen = self.seen + n``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, inputs):
        self.seen = self.seen + inputs.shape[0]
        return inputs


def batch_norm_model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), SampleCounter(), torch.nn.Tanh(), torch.nn.Linear(64, 4)
    ).double()
    return model, (torch.randn(GLOBAL, 32, dtype=torch.float64), torch.randn(GLOBAL, 4, dtype=torch.float64))


def test_a_replay_after_an_oom_starts_from_the_buffers_the_failed_attempt_started_from():
    model, batch = batch_norm_model_and_batch()
    optimizer = make_optimizer("sgd", model)
    room = (transient_bytes(model, optimizer, batch, 8) + transient_bytes(model, optimizer, batch, 16)) // 2
    device = bf.SimulatedDevice("1GiB")
    batcher = Microbatcher(model, optimizer, loss_fn=F.mse_loss, device=device, micro_batch_size=16, grow_after=None)
    reference, _ = batch_norm_model_and_batch()
    clean = Microbatcher(reference, make_optimizer("sgd", reference), loss_fn=F.mse_loss, micro_batch_size=16)
    for step in range(4):
        if step == 2:  # another tenant arrives: room for micro-batches of 8, not 16
            device.counter.limit_bytes = device.live_bytes() + room
            clean.current_micro_batch_size = 8  # the reference runs the same sizes without an OOM
        batcher.step(batch)
        clean.step(batch)
    assert [record.micro_batch_size for record in batcher.history] == [16, 16, 8, 8]
    assert [(record.ooms, record.replays) for record in batcher.history] == [(0, 0), (0, 0), (1, 1), (0, 0)]
    assert [record.micro_batch_size for record in clean.history] == [16, 16, 8, 8]
    assert int(model[1].num_batches_tracked) == 4 + 4 + 8 + 8 and int(model[2].seen) == 4 * GLOBAL
    torch.testing.assert_close(dict(model.named_buffers()), dict(reference.named_buffers()), rtol=0, atol=0)
    torch.testing.assert_close(dict(model.named_parameters()), dict(reference.named_parameters()), rtol=0, atol=0)


def test_other_errors_propagate_unchanged():
    model, batch = model_and_batch()
    batcher = Microbatcher(
        model, make_optimizer("sgd", model), loss_fn=lambda out, target: out.missing, micro_batch_size=8
    )
    with pytest.raises(AttributeError, match="missing"):
        batcher.step(batch)


def test_a_capacity_drop_mid_run_keeps_every_step_and_sample():
    work = gpt_tiny(seq_len=16)
    inputs, targets = work.sample_batch
    batch = (inputs.repeat(4, 1), targets.repeat(4, 1))  # a global batch of 16 sequences
    device = bf.SimulatedDevice("1GiB")
    batcher = Microbatcher(
        work.model, work.optimizer, loss_fn=work.loss_fn, device=device, micro_batch_size=16, grow_after=None
    )
    steps, drop = 20, 10  # enough steps on each side of the drop: more only repeat the same step
    for step in range(steps):
        if step == drop:  # another tenant arrives: what is live now, plus room for micro-batches of 4, not 8
            room = (
                transient_bytes(work.model, work.optimizer, batch, 4, work.loss_fn)
                + transient_bytes(work.model, work.optimizer, batch, 8, work.loss_fn)
            ) // 2
            device.counter.limit_bytes = device.live_bytes() + room
        batcher.step(batch)
    assert len(batcher.history) == steps and sum(record.samples for record in batcher.history) == steps * 16
    assert {int(state["step"]) for state in work.optimizer.state.values()} == {steps}
    assert all(record.micro_batch_size == 16 and record.ooms == 0 for record in batcher.history[:drop])
    assert batcher.history[drop].ooms == 2 and all(record.micro_batch_size == 4 for record in batcher.history[drop:])


def test_it_grows_back_after_clean_steps_but_never_above_a_failure():
    model, batch = model_and_batch()
    capacity = (step_peak("sgd", 16) + step_peak("sgd", 32)) // 2
    device = bf.SimulatedDevice(capacity)
    batcher = Microbatcher(
        model, make_optimizer("sgd", model), loss_fn=F.mse_loss, device=device, micro_batch_size=64, grow_after=2
    )
    for _ in range(6):
        batcher.step(batch)
    sizes = [record.micro_batch_size for record in batcher.history]
    assert batcher.smallest_failure == 32 and sizes[-1] <= 32  # 64 and 32 failed
    assert (
        max(sizes) <= 32 and sum(record.ooms for record in batcher.history) >= 3
    )  # it tried 32 again after clean steps


def test_without_a_size_it_finds_one_on_the_first_batch():
    model, batch = model_and_batch()
    capacity = (step_peak("sgd", 16) + step_peak("sgd", 32)) // 2
    # The Microbatcher's own loop: its loss call drops the output, a later micro-batch runs with the
    # window's gradients alive, and the whole batch stays on the device beside it (headroom: its bytes).
    work = bf.Workload(model, batch, F.mse_loss, make_optimizer("sgd", model), keep_output=False, accumulating=True)
    held = sum(tensor.untyped_storage().nbytes() for tensor in batch)
    found = bf.search_workload(work, device=bf.SimulatedDevice(capacity), max_batch_size=GLOBAL, margin=held)
    batcher = Microbatcher(model, make_optimizer("sgd", model), loss_fn=F.mse_loss, device=bf.SimulatedDevice(capacity))
    batcher.step(batch)
    assert batcher.history[0].micro_batch_size == found.batch_size and batcher.history[0].samples == GLOBAL


def test_the_evaluator_shrinks_on_oom_without_touching_training():
    model, batch = model_and_batch()
    full = model(batch[0]).detach()
    trainer = Microbatcher(model, make_optimizer("sgd", model), loss_fn=F.mse_loss, micro_batch_size=64)
    evaluator = EvalMicrobatcher(
        model,
        device=bf.SimulatedDevice(_eval_capacity(model, batch)),
        micro_batch_size=64,
        forward_fn=lambda m, b: m(b[0]),
    )
    outputs = evaluator.run(batch)
    torch.testing.assert_close(outputs, full, rtol=0, atol=1e-12)
    assert evaluator.ooms >= 1 and evaluator.current_micro_batch_size < 64 and trainer.current_micro_batch_size == 64
    assert model.training


def _eval_capacity(model, batch) -> int:
    device = bf.SimulatedDevice("1GiB")
    device.register(model.parameters())
    device.register(batch)
    base = device.live_bytes()
    device.reset_peak()
    with device.measuring(), torch.no_grad():
        model(batch[0][:10])
    return device.peak_bytes() + (device.peak_bytes() - base) // 2  # room for 10-15 rows, not 64


def test_bad_arguments():
    model, _ = model_and_batch()
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer or None, got 0"):
        Microbatcher(model, make_optimizer("sgd", model), micro_batch_size=0)
    with pytest.raises(ValueError, match="grow_after must be at least 1 or None"):
        Microbatcher(model, make_optimizer("sgd", model), grow_after=0)


class TokenModel(torch.nn.Module):
    """Per-sample mean of a masked per-token loss: padding never counts."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32, dtype=torch.float64)
        self.head = torch.nn.Linear(32, 50, dtype=torch.float64)

    def forward(self, input_ids, attention_mask):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        per_token = F.cross_entropy(logits.transpose(1, 2), input_ids, reduction="none") * attention_mask
        return {"loss": (per_token.sum(1) / attention_mask.sum(1)).mean()}


def token_batch():
    torch.manual_seed(0)
    lengths = torch.tensor([4, 16, 9, 12, 3, 16, 7, 10, 5, 14, 8, 11])
    mask = (torch.arange(16)[None, :] < lengths[:, None]).to(torch.float64)
    return {"input_ids": torch.randint(0, 50, (12, 16)), "attention_mask": mask}


def test_max_tokens_packs_by_tokens_and_keeps_the_full_batch_gradient():
    batch = token_batch()
    torch.manual_seed(1)
    model = TokenModel()
    reference = copy.deepcopy(model)
    batcher = Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), max_tokens=32)
    slices = batcher._slices(batch, 32)
    tokens = batch["attention_mask"].sum(1)
    assert slices[0][0] == 0 and slices[-1][1] == 12 and all(a[1] == b[0] for a, b in itertools.pairwise(slices))
    assert all(tokens[start:stop].sum() <= 32 for start, stop in slices) and len(slices) > 3
    batcher.step(batch)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(**batch)["loss"].backward()
    optimizer.step()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    assert batcher.history[-1].micro_batches == len(slices)


def test_max_tokens_halves_the_budget_on_oom():
    batch = token_batch()

    def peak(budget: int) -> int:
        torch.manual_seed(1)
        model = TokenModel()
        device = bf.SimulatedDevice("1GiB")
        batcher = Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), device=device, max_tokens=budget)
        for _ in range(2):
            batcher.step(batch)
        return device.peak_bytes()

    torch.manual_seed(1)
    model = TokenModel()
    capacity = (peak(32) + peak(64)) // 2
    batcher = Microbatcher(
        model, torch.optim.SGD(model.parameters(), lr=0.1), device=bf.SimulatedDevice(capacity), max_tokens=64
    )
    for _ in range(2):
        batcher.step(batch)
    assert batcher.current_max_tokens == 32 and sum(record.ooms for record in batcher.history) >= 1
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), max_tokens=0)
    with pytest.raises(RuntimeError, match=r"a single sample holds more tokens \(16 here\) than the budget of 8"):
        Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), max_tokens=8).step(batch)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_oom_injected_in_forward_or_backward_recovers_exactly(phase):
    model, batch = model_and_batch(60)
    calls = []

    def out_of_memory_once(*args):
        calls.append(phase)
        if len(calls) == 3:  # the third micro-batch of the first attempt
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected in {phase})")

    layer = model[2]
    handle = (
        layer.register_forward_hook(out_of_memory_once)
        if phase == "forward"
        else layer.register_full_backward_hook(out_of_memory_once)
    )
    optimizer = make_optimizer("adamw", model)
    batcher = Microbatcher(model, optimizer, loss_fn=F.mse_loss, micro_batch_size=16)
    for _ in range(2):
        batcher.step(batch)
    handle.remove()
    expected, _ = reference_step("adamw", samples=60)
    for mine, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    assert batcher.history[0].ooms == 1 and batcher.history[0].micro_batch_size == 8  # halved and replayed
    assert {int(state["step"]) for state in optimizer.state.values()} == {2}


def test_a_short_batch_does_not_shrink_the_micro_batch_for_good():
    model, batch = model_and_batch(64)
    batcher = Microbatcher(model, make_optimizer("sgd", model), loss_fn=F.mse_loss, micro_batch_size=16)
    batcher.step((batch[0][:3], batch[1][:3]))  # a short last batch of an epoch
    batcher.step(batch)
    assert batcher.history[0].micro_batch_size == 3 and batcher.history[1].micro_batch_size == 16


def test_token_weighting_matches_a_token_mean_loss():
    batch = token_batch()

    def token_mean(model, piece):  # a loss averaged over every token of the batch (Hugging Face style)
        logits = model.head(torch.tanh(model.embed(piece["input_ids"])))
        per_token = (
            F.cross_entropy(logits.transpose(1, 2), piece["input_ids"], reduction="none") * piece["attention_mask"]
        )
        return per_token.sum() / piece["attention_mask"].sum()

    torch.manual_seed(1)
    model = TokenModel()
    reference = copy.deepcopy(model)
    batcher = Microbatcher(
        model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=token_mean, max_tokens=32, weight="tokens"
    )
    batcher.step(batch)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    token_mean(reference, batch).backward()
    optimizer.step()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="weight must be 'samples'"):
        Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), weight="bytes")


def always_out_of_memory(*args):
    raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def test_even_the_floor_running_out_of_memory_is_a_no_batch_fits_error():
    capacity = (step_peak("sgd", 16) + step_peak("sgd", 32)) // 2  # 16 fits, 32 does not
    model, batch = model_and_batch()
    batcher = Microbatcher(
        model,
        make_optimizer("sgd", model),
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice(capacity),
        micro_batch_size=64,
        min_batch_size=32,
    )
    with pytest.raises(bf.NoBatchFitsError, match=r"even a micro-batch of 32 \(the floor, min_batch_size=32\)"):
        for _ in range(2):  # 32 may still fit in the first step, before the optimizer state exists
            batcher.step(batch)
    model, batch = model_and_batch()
    model[2].register_forward_hook(always_out_of_memory)
    tiny = Microbatcher(model, make_optimizer("sgd", model), loss_fn=F.mse_loss, micro_batch_size=4)
    with pytest.raises(RuntimeError, match="even a micro-batch of 1 .*: use amp_dtype") as caught:
        tiny.step(batch)  # still a RuntimeError for callers that catch that
    assert isinstance(caught.value, bf.NoBatchFitsError)
    with pytest.raises(ValueError, match=r"micro_batch_size \(8\) is below min_batch_size \(16\)"):
        Microbatcher(model, make_optimizer("sgd", model), micro_batch_size=8, min_batch_size=16)


def test_a_token_budget_stops_at_the_longest_sample_with_a_no_batch_fits_error(caplog):
    torch.manual_seed(1)
    model = TokenModel()
    model.head.register_forward_hook(always_out_of_memory)
    batcher = Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), max_tokens=48)
    with pytest.raises(bf.NoBatchFitsError, match="even a budget of 16 tokens"):
        batcher.step(token_batch())  # the longest sample holds 16 tokens: 48, 24, then 16 alone
    assert "at micro-batch 24" in caplog.text and "at micro-batch 8" not in caplog.text
    assert batcher.history == [] and batcher.current_max_tokens == 48


def test_the_evaluator_raises_no_batch_fits_error_when_one_sample_does_not_fit():
    model, batch = model_and_batch()
    evaluator = EvalMicrobatcher(
        model, device=bf.SimulatedDevice("1KiB"), micro_batch_size=8, forward_fn=lambda m, b: m(b[0])
    )
    with pytest.raises(bf.NoBatchFitsError, match="even one sample runs out of memory in evaluation"):
        evaluator.run(batch)
    assert evaluator.settings.micro_batch_size == 8 and evaluator.current_micro_batch_size == 1


def test_settings_stay_as_given_while_the_live_sizes_shrink():
    capacity = (step_peak("sgd", 16) + step_peak("sgd", 32)) // 2
    model, batch = model_and_batch()
    batcher = Microbatcher(
        model,
        make_optimizer("sgd", model),
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice(capacity),
        micro_batch_size=64,
    )
    for _ in range(2):  # 32 may still fit in the first step, before the optimizer state exists
        batcher.step(batch)
    assert batcher.settings.micro_batch_size == 64 and batcher.current_micro_batch_size == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        batcher.settings.micro_batch_size = 8
    with pytest.warns(
        DeprecationWarning, match=r"Microbatcher.micro_batch_size is deprecated.*current_micro_batch_size"
    ):
        assert batcher.micro_batch_size == 16  # the old spelling still reads the live size, for one release
    with pytest.warns(DeprecationWarning, match="current_max_tokens"):
        assert batcher.max_tokens is None
    evaluator = EvalMicrobatcher(model, micro_batch_size=4)
    with pytest.warns(DeprecationWarning, match="EvalMicrobatcher.micro_batch_size"):
        assert evaluator.micro_batch_size == 4


def test_replays_count_the_micro_batches_run_again_not_the_ooms():
    model, batch = model_and_batch(60)
    calls = []

    def out_of_memory_once(*args):
        calls.append(1)
        if len(calls) == 3:  # the third micro-batch of the first attempt: two completed before it
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = model[2].register_forward_hook(out_of_memory_once)
    batcher = Microbatcher(model, make_optimizer("sgd", model), loss_fn=F.mse_loss, micro_batch_size=16)
    batcher.step(batch)
    batcher.step(batch)
    handle.remove()
    first, second = batcher.history
    assert (first.ooms, first.replays) == (1, 2) and (second.ooms, second.replays) == (0, 0)


def test_a_step_record_says_what_happened_in_a_sentence_and_as_json():
    record = StepRecord(4, 12, 5, 2, 3, 60, max_tokens=32)
    assert record.summary() == (
        "Step 4: 60 samples in 5 micro-batches of at most 12 (32 tokens each at most); "
        "2 out-of-memory errors, 3 micro-batches run again."
    )
    assert json.loads(json.dumps(record.to_dict())) == {
        "step": 4,
        "micro_batch_size": 12,
        "micro_batches": 5,
        "ooms": 2,
        "replays": 3,
        "samples": 60,
        "max_tokens": 32,
    }


def test_the_first_search_takes_the_keywords_of_find_max_batch_size(monkeypatch, tmp_path):
    model, batch = model_and_batch()
    capacity = 2 * step_peak("sgd", 32)  # room for the 30% margin beside the whole batch and the window's gradients
    keywords = {"min_batch_size": 2, "strategy": "binary", "margin": 0.3, "max_trials": 20, "steps": 3, "trace": False}
    found = bf.find_max_batch_size(
        model,
        batch,
        loss_fn=F.mse_loss,
        optimizer=make_optimizer("sgd", model),
        device=bf.SimulatedDevice(capacity),
        max_batch_size=GLOBAL,
        **keywords,
    )
    plain = bf.find_max_batch_size(
        model, batch, loss_fn=F.mse_loss, optimizer=make_optimizer("sgd", model), device=bf.SimulatedDevice(capacity)
    )
    assert found.batch_size < plain.batch_size  # the margin counts
    seen = []
    real = microbatch.search_workload
    monkeypatch.setattr(microbatch, "search_workload", lambda w, s, **kw: seen.append((w, s)) or real(w, s, **kw))
    batcher = Microbatcher(
        model,
        make_optimizer("sgd", model),
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice(capacity),
        amp_dtype="bf16",
        cache=tmp_path,
        **keywords,
    )
    batcher.step(batch)
    ((workload, settings),) = seen
    held = int(0.3 * capacity) + sum(tensor.untyped_storage().nbytes() for tensor in batch)  # the margin, and the batch
    assert settings == bf.SearchSettings(max_batch_size=GLOBAL, cache=tmp_path, **{**keywords, "margin": held})
    assert workload.amp_dtype == torch.bfloat16 and workload.accumulating and batcher.settings.search.margin == 0.3
    assert batcher.settings.micro_batch_size is None and batcher.current_micro_batch_size is not None


def test_amp_dtype_runs_every_micro_batch_under_autocast():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    dtypes = []

    def loss_fn(output, target):
        dtypes.append(output.dtype)
        return F.mse_loss(output.float(), target)

    batcher = Microbatcher(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn, micro_batch_size=4, amp_dtype="bf16"
    )
    batcher.step((torch.randn(8, 8), torch.randn(8, 2)))
    assert dtypes == [torch.bfloat16, torch.bfloat16] and model.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="amp_dtype must be torch.float16, torch.bfloat16"):
        Microbatcher(model, torch.optim.SGD(model.parameters(), lr=0.1), amp_dtype="fp8")


def test_the_arguments_follow_find_max_batch_size():
    import inspect

    parameters = inspect.signature(Microbatcher).parameters
    assert [name for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == ["model", "optimizer"]
    names = list(parameters)
    assert parameters["step_fn"].kind is inspect.Parameter.KEYWORD_ONLY
    assert names.index("loss_fn") < names.index("step_fn")
    for name in ("loss_fn", "device", "micro_batch_size", "amp_dtype", "min_batch_size", "strategy", "margin"):
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
    for name in ("min_batch_size", "strategy", "margin", "max_trials", "steps", "trace", "cache"):
        assert parameters[name].default == inspect.signature(bf.find_max_batch_size).parameters[name].default


def test_the_searched_micro_batch_runs_with_the_windows_gradients_and_the_whole_batch_held():
    # The whole batch is on the device while its micro-batches run, and a later micro-batch runs with the
    # window's gradients alive: a search of a plain step chose 548 here, which ran out of memory in step 1.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batcher = bf.Microbatcher(model, optimizer, loss_fn=torch.nn.CrossEntropyLoss(), device="sim:2MiB")
    for _ in range(3):
        inputs = torch.randn(1024, 64)
        batcher.step((inputs, inputs[:, :10].argmax(dim=1)))
    assert [record.ooms for record in batcher.history] == [0, 0, 0]
    assert 1 < batcher.history[0].micro_batches == batcher.history[-1].micro_batches  # it accumulates, unchanged


def dropout_run(oom_at_step: int | None) -> dict:
    """Four steps of a dropout model from seed 0; from step 2 micro-batches of 8, through an OOM or chosen."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 4)).double()
    batch = (torch.randn(GLOBAL, 32, dtype=torch.float64), torch.randn(GLOBAL, 4, dtype=torch.float64))
    optimizer = make_optimizer("sgd", model)
    room = (transient_bytes(model, optimizer, batch, 8) + transient_bytes(model, optimizer, batch, 16)) // 2
    device = bf.SimulatedDevice("1GiB") if oom_at_step is not None else None
    batcher = Microbatcher(model, optimizer, loss_fn=F.mse_loss, device=device, micro_batch_size=16, grow_after=None)
    for step in range(4):
        if step == 2 and device is not None:
            device.counter.limit_bytes = device.live_bytes() + room
        elif step == 2:
            batcher.current_micro_batch_size = 8
        batcher.step(batch)
    assert [record.micro_batch_size for record in batcher.history] == [16, 16, 8, 8]
    assert [record.ooms for record in batcher.history] == ([0, 0, 1, 0] if device is not None else [0, 0, 0, 0])
    return {name: value.detach().clone() for name, value in model.named_parameters()}


def test_a_replay_after_an_oom_draws_the_dropout_masks_the_failed_attempt_drew():
    """The random state is put back with the buffers: the replay is the step a clean run of 8s takes, bit for bit."""
    torch.testing.assert_close(dropout_run(oom_at_step=2), dropout_run(oom_at_step=None), rtol=0, atol=0)
