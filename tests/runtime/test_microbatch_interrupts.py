"""Ctrl-C during ``Microbatcher.step`` on a simulated device: ``KeyboardInterrupt`` reaches the caller (it used to be
dropped when it landed in the accounting's weak-reference callback, a storage left counted), the step is dropped
whole or done whole, and the next step runs as if nothing had happened. Real signals (``os.kill``), sent from inside
the step: a module's forward, a storage's release, the optimizer step."""

from __future__ import annotations

import gc
import os
import random
import signal
import sys

import pytest
import torch
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.accounting import LiveBytes
from batchfit.runtime.microbatch import Microbatcher


def send_sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def setup(guard: bool = False) -> tuple[torch.nn.Module, Microbatcher, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).double()
    batch = (torch.randn(48, 32, dtype=torch.float64), torch.randn(48, 4, dtype=torch.float64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batcher = Microbatcher(
        model,
        optimizer,
        loss_fn=F.mse_loss,
        device=bf.SimulatedDevice("1GiB"),
        micro_batch_size=16,
        guard_optimizer_step=guard,
    )
    batcher.step(batch)  # momentum to keep
    return model, batcher, batch


def snapshot(model: torch.nn.Module, batcher: Microbatcher) -> list[torch.Tensor]:
    momentum = [s["momentum_buffer"].clone() for s in batcher.optimizer.state.values()]
    return [p.detach().clone() for p in model.parameters()] + momentum


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def counts_are_whole(counter: LiveBytes) -> bool:
    gc.collect()
    counter.settle()
    entries = list(counter._refs.values())
    return all(ref() is not None for ref, *_ in entries) and counter.live_bytes == sum(e[1] for e in entries)


def assert_next_step_as_if_none_was_interrupted(model, batcher, batch, reference, steps_before: int) -> None:
    """Nothing of the interrupted step kept (``reference`` is where it began), and the next step gives what
    the reference's gives; the counts whole, and as the reference device's."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert torch._C._len_torch_dispatch_stack() == 0
    assert len(batcher.history) == steps_before
    assert all(p.grad is None for p in model.parameters())
    ref_model, ref_batcher = reference
    assert same(snapshot(model, batcher), snapshot(ref_model, ref_batcher))
    assert batcher.step(batch) == ref_batcher.step(batch)
    assert same(snapshot(model, batcher), snapshot(ref_model, ref_batcher))
    assert len(batcher.history) == steps_before + 1
    assert counts_are_whole(batcher.device.counter)
    assert batcher.device.live_bytes() == ref_batcher.device.live_bytes()


@pytest.mark.parametrize("seed", range(3))
def test_a_ctrl_c_in_a_forward_stops_the_step_and_the_next_step_works(seed):
    model, batcher, batch = setup()
    reference = setup()[:2]  # the same, built again: its own device
    at, calls = random.Random(seed).randrange(1, 4), []

    def hook(module, args):
        calls.append(1)
        if len(calls) == at:
            send_sigint()  # deferred: raised at the next op

    handle = model[1].register_forward_pre_hook(hook)
    with pytest.raises(KeyboardInterrupt):
        batcher.step(batch)
    handle.remove()
    assert_next_step_as_if_none_was_interrupted(model, batcher, batch, reference, 1)


@pytest.mark.parametrize("seed", range(3))
def test_a_ctrl_c_inside_a_storage_release_is_not_dropped(monkeypatch, seed):
    """Outside any deferral Python raised it inside the accounting's weak-reference callback and dropped it: the
    step went on, and the storage being uncounted stayed counted."""
    model, batcher, batch = setup()
    reference = setup()[:2]  # the same, built again: its own device
    forget, releases = LiveBytes._forget, []
    at = random.Random(seed).randrange(1, 20)

    def interrupted(self, key, ref=None):
        if sys._getframe(1).f_code.co_name == "_released":
            releases.append(key)
            if len(releases) == at:
                send_sigint()
        return forget(self, key, ref)

    monkeypatch.setattr(LiveBytes, "_forget", interrupted)
    with pytest.raises(KeyboardInterrupt):
        batcher.step(batch)
    monkeypatch.setattr(LiveBytes, "_forget", forget)
    assert len(releases) >= at
    assert_next_step_as_if_none_was_interrupted(model, batcher, batch, reference, 1)


@pytest.mark.parametrize("guard", [False, True], ids=["unguarded", "guarded"])
def test_a_ctrl_c_in_the_optimizer_step_is_raised_once_the_step_is_done(guard):
    """Not half an optimizer step: the step completes (recorded), then ``KeyboardInterrupt``."""
    model, batcher, batch = setup(guard)
    reference = setup(guard)[:2]  # the same, built again: its own device
    reference[1].step(batch)
    handle = batcher.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: send_sigint())
    with pytest.raises(KeyboardInterrupt):
        batcher.step(batch)
    handle.remove()
    assert_next_step_as_if_none_was_interrupted(model, batcher, batch, reference, 2)
