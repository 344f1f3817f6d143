"""An out-of-memory error anywhere in one rank's FSDP2 step (forward, loss, backward, optimizer step)
leaves the trials after it as a fresh prober's (issue 32, item 1): FSDP2 is brought back to rest
before the state is restored, and the simulated device raises where CUDA would, mid-step."""

from __future__ import annotations

import json

import pytest
import torch

import batchfit as bf
from batchfit.cli.workloads import load_workload
from batchfit.parallel.copied import ShardedCopy
from batchfit.parallel.models import TinyTransformer
from batchfit.parallel.one_rank import RankProber
from batchfit.parallel.one_rank import RankWorkload
from batchfit.parallel.settings import Parallelism
from batchfit.search.runner import probe_workload
from batchfit.search.runner import search_workload
from batchfit.search.strategies import Binary
from batchfit.search.strategies import SearchSpace
from cli_runner import invoke
from strategy_harness import run_strategy

VOCAB_SIZE, SEQ_LEN = 64, 16


# The host's own allocator running out, as torch words it on Linux (the CPU a one-rank trial may run on).
HOST_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes. Error code 12"


class Fault:
    """Raises ``torch.OutOfMemoryError`` (or, ``host``, the CPU allocator's ``RuntimeError``) at the
    ``call``-th call of ``phase`` once armed."""

    def __init__(self) -> None:
        self.arm(None, 0)

    def arm(self, phase: str | None, call: int, host: bool = False) -> None:
        self.phase, self.call, self.calls, self.fired, self.host = phase, call, 0, False, host

    def raises_next(self, phase: str) -> bool:
        return phase == self.phase and self.calls + 1 == self.call

    def tick(self, phase: str) -> None:
        if phase != self.phase:
            return
        self.calls += 1
        if self.calls == self.call:
            self.fired = True
            if self.host:
                raise RuntimeError(f"injected at call {self.call} of {phase}: {HOST_OOM}")
            raise torch.OutOfMemoryError(f"injected at call {self.call} of {phase}: CUDA out of memory")


FAULT = Fault()


class FaultyAdamW(torch.optim.AdamW):
    """AdamW whose step may raise half-way: after the first parameter's state is made."""

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if FAULT.raises_next("optimizer") and params:
            self.state[params[0]]["exp_avg"] = torch.zeros_like(params[0])  # state made, then the error
        FAULT.tick("optimizer")
        return super().step(closure)


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    FAULT.tick("loss")
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _faulty_workload(world_size: int):
    """A small transformer as one rank of ``world_size`` (its copy sharded with FSDP2) whose step
    can raise in the second block's forward (after FSDP2 gathered it), in the loss, in backward
    (from the first block's output gradient: the later blocks' backward done, FSDP2's hooks
    half-way) and in the optimizer step. Hooks and loss travel with the copy."""
    model = TinyTransformer(vocab_size=VOCAB_SIZE)
    model.layers[1].register_forward_pre_hook(lambda module, args: FAULT.tick("forward"))

    def in_backward(module, args, output):
        output.register_hook(lambda grad: FAULT.tick("backward"))

    model.layers[0].register_forward_hook(in_backward)
    sample = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN))
    work = bf.Workload(model, sample, loss_fn=_loss, optimizer=FaultyAdamW(model.parameters()))
    return ShardedCopy(work, Parallelism(world_size=world_size))


def _fresh_trial(work, batch_size: int) -> bf.Trial:
    with RankProber(work, bf.SimulatedDevice("64MiB"), steps=2, limit_bytes=None) as prober:
        return prober.probe(batch_size)


@pytest.fixture(autouse=True)
def _disarmed():
    FAULT.arm(None, 0)
    yield
    FAULT.arm(None, 0)


FAILED_PHASE = {"forward": "forward", "loss": "forward", "backward": "backward", "optimizer": "optimizer"}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    ("phase", "call", "host"),
    [
        ("forward", 1, False),
        ("forward", 2, True),
        ("loss", 2, False),
        ("backward", 1, True),
        ("backward", 2, False),
        ("optimizer", 2, False),
    ],
)
def test_an_oom_anywhere_in_a_sharded_step_leaves_the_next_trial_as_a_fresh_probers(world_size, phase, call, host):
    work = _faulty_workload(world_size)
    device = bf.SimulatedDevice("64MiB")
    with RankProber(work, device, steps=2, limit_bytes=None) as prober:
        FAULT.arm(phase, call, host)
        failed = prober.probe(4)
        assert FAULT.fired and not failed.fits and failed.oom, failed
        FAULT.arm(None, 0)
        assert failed.failed_phase == FAILED_PHASE[phase] and failed.steps == call - 1
        assert device.live_bytes() == prober.baseline_bytes  # gathered copies, gradients: nothing left counted
        after = [prober.probe(4), prober.probe(3)]
    fresh = [_fresh_trial(work, 4), _fresh_trial(work, 3)]
    assert [(t.fits, t.steps, t.peak_bytes, t.phase_peak_bytes) for t in after] == [
        (t.fits, t.steps, t.peak_bytes, t.phase_peak_bytes) for t in fresh
    ]
    assert all(t.fits for t in after)


def test_after_an_oom_in_backward_the_shards_and_optimizer_are_as_they_were_and_fsdp2_still_trains():
    work = _faulty_workload(2)
    with RankProber(work, bf.SimulatedDevice("64MiB"), steps=2, limit_bytes=None) as prober:
        step = prober._prober.workload  # the rank's own step: its sharded model and rebuilt optimizer
        before = [p.to_local().clone() for p in step.model.parameters()]
        FAULT.arm("backward", 2)
        assert not prober.probe(4).fits
        FAULT.arm(None, 0)
        assert all(type(p).__name__ == "DTensor" for p in step.model.parameters())  # shards, not gathered copies
        assert all(torch.equal(a, p.to_local()) for a, p in zip(before, step.model.parameters(), strict=True))
        assert not step.optimizer.state and all(p.grad is None for p in step.model.parameters())
        _loss(step.model(step.sample_batch), step.sample_batch).backward()  # FSDP2 runs a plain step after it
        assert all(p.grad is not None for p in step.model.parameters())


def _replayed(work, top: int, device: str) -> tuple[list[int], int | None, dict[int, bf.Trial]]:
    """Binary search over ``[1, top]`` with every size decided by its own trial on a fresh prober:
    the sizes tried, the answer, and each size's fresh trial."""
    fresh: dict[int, bf.Trial] = {}

    def fits(size: int) -> bool:
        fresh[size] = probe_workload(work, size, device=device)
        return fresh[size].fits

    sizes, answer = run_strategy(Binary(), SearchSpace(1, top), fits)
    return sizes, answer, fresh


def _outcome(trial: bf.Trial | dict) -> tuple:
    """What a trial found: fits, full steps run, the phase an OOM came in, the peak."""
    row = trial if isinstance(trial, dict) else trial.to_dict()
    return row["fits"], row["steps"], row["failed_phase"], row["peak_bytes"]


def test_a_search_at_four_ranks_past_the_edge_tries_what_fresh_trials_decide():
    """Far past the edge the error comes in the first forward, inside FSDP2's, as CUDA raises it
    (no step runs on to its end), and every trial after it is what a fresh prober finds."""
    work = RankWorkload(TinyTransformer, 32, Parallelism(world_size=4))
    result = search_workload(work, device="sim:6MiB", strategy="binary", trace=False, max_batch_size=4096)
    sizes, answer, fresh = _replayed(work, 4096, "sim:6MiB")
    assert [t.batch_size for t in result.trials] == sizes and result.batch_size == answer > 1
    assert [_outcome(t) for t in result.trials] == [_outcome(fresh[size]) for size in sizes]
    far = [t for t in result.trials if t.batch_size > 2 * answer]
    assert far and all((t.steps, t.failed_phase) == (0, "forward") for t in far)
    assert "backward" in {t.failed_phase for t in result.trials}  # and at the edge, mid-backward


def test_the_cli_find_at_two_ranks_past_the_edge_answers_what_fresh_trials_decide(tmp_path, monkeypatch):
    """``batchfit find gpt-tiny --device sim:16MiB --strategy binary --no-trace --gpus 2``: the first
    trial is far past the edge and runs out of memory in its first forward; every trial is what a fresh
    prober finds, and so is the answer."""
    monkeypatch.chdir(tmp_path)
    args = ["find", "gpt-tiny", "--device", "sim:16MiB", "--strategy", "binary", "--no-trace", "--gpus", "2"]
    result = invoke(*args, "--max-batch-size", "4096", "--json", "out.json")
    assert result.exit_code == 0, result.output
    found = json.loads((tmp_path / "out.json").read_text())
    work = ShardedCopy(load_workload("gpt-tiny"), Parallelism(world_size=2))
    sizes, answer, fresh = _replayed(work, 4096, "sim:16MiB")
    assert [t["batch_size"] for t in found["trials"]] == sizes and found["batch_size"] == answer > 1
    assert [_outcome(t) for t in found["trials"]] == [_outcome(fresh[size]) for size in sizes]
    assert (found["trials"][0]["steps"], found["trials"][0]["failed_phase"]) == (0, "forward")


def test_evaluation_trials_of_a_sharded_model_follow_one_another():
    """A no-grad forward leaves the root's parameters gathered (FSDP2 does not reshard the root after
    forward): the restore brings them back to the shards before it puts the state back."""
    model = TinyTransformer(vocab_size=VOCAB_SIZE)
    sample = torch.randint(0, VOCAB_SIZE, (2, SEQ_LEN))
    work = ShardedCopy(bf.Workload(model, sample, loss_fn=_loss, mode="eval"), Parallelism(world_size=2))
    with RankProber(work, bf.SimulatedDevice("64MiB"), steps=2, limit_bytes=None) as prober:
        trials = [prober.probe(4), prober.probe(8), prober.probe(4)]
    assert all(t.fits for t in trials) and trials[0].peak_bytes == trials[2].peak_bytes < trials[1].peak_bytes
    assert trials[1].peak_bytes == _fresh_trial(work, 8).peak_bytes


@pytest.mark.slow  # a campaign: 60 faulted trials per world size (make reliability runs more)
@pytest.mark.parametrize("world_size", [2, 4])
def test_an_oom_at_any_op_of_a_sharded_step_leaves_the_next_trial_as_a_fresh_probers(world_size):
    """The error raised at a seeded op k of the step (before the op runs, or after, its output still held),
    anywhere in it: inside FSDP2's all-gathers, its hooks, the reduce-scatters."""
    from fault_campaigns import fsdp_campaign

    tally, phases = fsdp_campaign(world_size, range(60))
    assert (tally.tried, tally.broke) == (60, 0), tally.broken
    assert phases == {"batch", "forward", "backward", "optimizer"}
