"""After every probe and search, all state is bitwise as before: also after an OOM in forward,
backward or the optimizer step, after another error, and after KeyboardInterrupt."""

from __future__ import annotations

import pytest
import torch

import batchfit as bf
from batchfit.search.prober import Prober
from models import cnn_bn
from models import mlp_tuple
from state_checks import assert_same
from state_checks import fingerprint
from state_checks import train_a_little


def _trained(build) -> bf.Workload:
    work = build()
    train_a_little(work)
    return work


def _phase_peaks(build, batch_size: int) -> dict[str, int]:
    device = bf.SimulatedDevice("1GiB")
    with Prober(_trained(build), device) as prober:
        return dict(prober.probe(batch_size).phase_peak_bytes)


@pytest.mark.parametrize("build", [mlp_tuple, cnn_bn], ids=["adam-mlp", "bn-cnn"])
def test_oom_anywhere_in_the_step_restores_everything_bitwise(build):
    """Capacities just under each phase's peak make the trial fail wherever memory first runs
    out; after each, the state is bitwise as before and live bytes are back at the baseline."""
    failed_in = set()
    for batch_size in (2, 16):
        for peak in _phase_peaks(build, batch_size).values():
            work = _trained(build)
            before = fingerprint(work)
            device = bf.SimulatedDevice(peak - 256)
            with Prober(work, device, limit_bytes=device.capacity_bytes()) as prober:
                trial = prober.probe(batch_size)
                assert trial.oom and not trial.fits
                assert device.live_bytes() == prober.baseline_bytes  # nothing left alive (pytorch#82218)
                assert_same(before, fingerprint(work))
            assert_same(before, fingerprint(work))
            failed_in.add(trial.failed_phase)
    PHASES_HIT[build.__name__] = failed_in


PHASES_HIT: dict[str, set[str]] = {}


def test_the_ooms_above_struck_in_forward_backward_and_the_optimizer_step():
    for build in (mlp_tuple, cnn_bn):
        if build.__name__ not in PHASES_HIT:
            test_oom_anywhere_in_the_step_restores_everything_bitwise(build)
    assert set().union(*PHASES_HIT.values()) == {"forward", "backward", "optimizer"}


def test_a_whole_search_with_ooms_restores_everything_bitwise():
    work = cnn_bn()
    train_a_little(work)
    before = fingerprint(work)
    result = bf.search_workload(work, device=bf.SimulatedDevice("400KiB"), strategy="binary", max_batch_size=64)
    assert result.oom_trials >= 2
    assert_same(before, fingerprint(work))


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom("inside the step"), KeyboardInterrupt(), RuntimeError("CUDA-free failure")])
def test_other_errors_propagate_unchanged_after_restoring(error):
    work = mlp_tuple()
    train_a_little(work)
    before = fingerprint(work)
    calls = []

    def failing_loss(output, targets):
        calls.append(1)
        if len(calls) == 2:  # in the second step, after the optimizer has stepped once
            raise error
        return torch.nn.functional.cross_entropy(output, targets)

    work.loss_fn = failing_loss
    device = bf.SimulatedDevice("1MiB")
    with pytest.raises(type(error)) as info:
        bf.search_workload(work, device=device, trace=False)  # the trace would make the loss's first calls
    assert info.value is error
    assert_same(before, fingerprint(work))


def test_an_error_in_every_step_propagates_past_the_trace(caplog):
    work = mlp_tuple()
    train_a_little(work)
    before = fingerprint(work)

    def broken_loss(output, targets):
        raise Boom("the user's bug")

    work.loss_fn = broken_loss
    with caplog.at_level("WARNING", logger="batchfit"), pytest.raises(Boom, match="the user's bug"):
        bf.search_workload(work, device=bf.SimulatedDevice("1MiB"), trace=True)
    assert "could not trace the workload (Boom: the user's bug); probing without an estimate" in caplog.text
    assert_same(before, fingerprint(work))


def test_a_fresh_optimizer_is_left_without_state():
    work = mlp_tuple()
    bf.search_workload(work, device=bf.SimulatedDevice("160KiB"))
    assert len(work.optimizer.state) == 0
    assert all(p.grad is None for p in work.model.parameters())


def test_snapshots_live_in_host_memory_and_are_not_counted():
    work = mlp_tuple()
    device = bf.SimulatedDevice("1MiB")
    with Prober(work, device) as prober:
        held = sum(t.numel() * t.element_size() for t in work.state_tensors())
        # parameters + the sample batch, rounded to 512-byte blocks; no copy of them
        assert held <= prober.baseline_bytes < 2 * held
