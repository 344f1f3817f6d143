"""FSDP2's CPU offload, traced on a fake accelerator in a child process: the sharded state in host
memory, and on the device what FSDP2 keeps there."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from batchfit import Workload
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.parallel import Parallelism
from batchfit.parallel import RankWorkload
from batchfit.parallel import TinyTransformer
from batchfit.parallel import accelerator
from batchfit.parallel import trace_rank
from batchfit.parallel.copied import ShardedCopy
from batchfit.parallel.copied import WorkloadSession
from batchfit.parallel.fit import largest_batch_size
from batchfit.parallel.trace import RankSession
from batchfit.parallel.world import fake_world
from batchfit.parallel.wrap import shard_model
from ddp_launch import LAUNCH

# One worker builds the module's shared fixture once under pytest-xdist (--dist loadgroup), not once per worker.
pytestmark = pytest.mark.xdist_group("offload")

OFFLOADED = ("sharded_parameters", "gradients", "optimizer_state")
OFFLOAD_2 = Parallelism(world_size=2, cpu_offload=True)
WIDE = functools.partial(TinyTransformer, vocab_size=1024, hidden_size=256, num_heads=4, num_layers=2)


@pytest.fixture(scope="module")
def traced():
    """One rank of 2 at micro-batch 2 x 32 without offload, and with it at 2 and 3 in one child."""
    plain = trace_rank(TinyTransformer, 2, 32, parallelism=Parallelism(world_size=2))
    with RankSession(TinyTransformer, 32, parallelism=OFFLOAD_2) as session:
        process = session._child._process
        offloaded = [session.trace(size) for size in (2, 3)]
    return plain, offloaded, session, process


def test_offload_keeps_the_sharded_state_in_host_memory(traced):
    plain, (offloaded, _), _, _ = traced
    assert {part: offloaded.breakdown[part] for part in OFFLOADED} == dict.fromkeys(OFFLOADED, 0)
    assert offloaded.state_bytes == dict.fromkeys(OFFLOADED, 0)  # on the device
    host = offloaded.host_breakdown
    assert host["sharded_parameters"] == plain.state_bytes["sharded_parameters"] > 0
    assert host["optimizer_state"] == plain.state_bytes["optimizer_state"] > 0
    assert host["gradients"] == host["sharded_parameters"]  # reduced shards, padded as the parameters are
    assert offloaded.host_peak_bytes == sum(host.values())
    assert plain.host_peak_bytes is None and "host_peak_bytes" not in plain.to_dict()
    assert offloaded.to_dict()["host_peak_bytes"] == offloaded.host_peak_bytes
    assert "Host memory" in offloaded.summary()


def test_the_device_keeps_what_it_did_less_the_sharded_state(traced):
    plain, (offloaded, _), _, _ = traced
    assert offloaded.peak_phase == plain.peak_phase == "backward"
    assert offloaded.peak_bytes == plain.peak_bytes - sum(plain.breakdown[part] for part in OFFLOADED)
    for part in ("unsharded_parameters", "activations", "batch", "temporaries"):
        assert offloaded.breakdown[part] == plain.breakdown[part] > 0, part


def test_a_later_size_costs_one_steady_step_in_the_same_child(traced):
    _, (two, three), session, process = traced
    assert (session.traces, session.steps_run) == (2, 3)
    assert three.peak_bytes > two.peak_bytes
    assert three.host_peak_bytes == two.host_peak_bytes  # the host holds the state, whatever the micro-batch
    assert process.poll() == 0  # the child ended with the session
    assert not accelerator.is_registered()  # and this process never had the fake accelerator


@pytest.mark.slow  # a child process of its own; offload's answers stay in make test
def test_an_error_in_the_child_is_raised_here_as_it_was():
    one_block = functools.partial(TinyTransformer, num_layers=1)  # nothing repeated to checkpoint
    parallelism = Parallelism(world_size=2, cpu_offload=True, activation_checkpointing="full")
    with pytest.raises(InputError, match="has none"):
        trace_rank(one_block, 1, 8, parallelism=parallelism)


@pytest.mark.slow
def test_a_child_that_dies_is_an_error_here_and_the_session_stops():
    with RankSession(TinyTransformer, 8, parallelism=OFFLOAD_2) as session:
        session._child._process.kill()
        with pytest.raises(RuntimeError, match="ended without an answer"):
            session.trace(1)
        with pytest.raises(InputError, match="in a new RankSession"):
            session.trace(1)


def test_a_model_that_does_not_pickle_is_one_line_before_any_child():
    with pytest.raises(InputError, match="must pickle"):
        trace_rank(lambda: TinyTransformer(), 1, 8, parallelism=OFFLOAD_2)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"world_size": 2, "sharding": "ddp"}, InputError, "CPUOffloadPolicy"),
        ({"sharding": "none"}, InputError, "CPUOffloadPolicy"),
        ({"world_size": 2, "cpu_offload": "yes"}, InputTypeError, "True or False"),
    ],
)
def test_offload_settings_outside_fsdp2_are_one_line(settings, error, message):
    with pytest.raises(error, match=message):
        Parallelism(**{"cpu_offload": True, **settings})


def test_real_trials_refuse_offload_in_one_line():
    work = Workload(torch.nn.Linear(4, 4), torch.randn(2, 4), loss_fn=lambda out, batch: out.sum())
    with pytest.raises(InputError, match="host and device are one"):
        ShardedCopy(work, OFFLOAD_2)
    with pytest.raises(InputError, match="host and device are one"):
        RankWorkload(TinyTransformer, 16, OFFLOAD_2)
    with pytest.raises(InputError, match="host and device are one"):
        WorkloadSession(
            Workload(torch.nn.Linear(4, 4), torch.randn(2, 4), optimizer=torch.optim.SGD), parallelism=OFFLOAD_2
        )
    with pytest.raises(InputError, match="fake tensors only"):
        RankSession(TinyTransformer, 16, parallelism=OFFLOAD_2, fake=False)
    with fake_world(OFFLOAD_2) as mesh, pytest.raises(InputError, match="CPU mesh"):
        shard_model(TinyTransformer(), mesh, OFFLOAD_2)


@pytest.mark.slow
def test_the_device_peak_does_not_depend_on_the_world_and_the_host_state_halves():
    two, four = (
        largest_batch_size(WIDE, 32, "64MiB", parallelism=Parallelism(world_size=n, cpu_offload=True)) for n in (2, 4)
    )
    assert two.batch_size == four.batch_size > 0
    assert two.estimate.peak_bytes == four.estimate.peak_bytes
    for part in OFFLOADED:
        halved = two.estimate.host_breakdown[part] / 2
        assert abs(four.estimate.host_breakdown[part] - halved) <= 0.01 * halved, part


@pytest.mark.slow
def test_without_offload_the_fake_accelerator_traces_what_the_cpu_mesh_does(tmp_path):
    """A process of its own runs both (the accelerator cannot be unregistered): the peaks, every part
    and every phase agree to the byte, once AdamW's ``step`` counters, which the accelerator keeps
    on the host as a GPU does, are counted with the device's optimizer state."""
    script = LAUNCH / "offload_fidelity.py"
    sides = {}
    for side in ("cpu", "accelerator"):
        run = subprocess.run([sys.executable, str(script), side], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        sides[side] = json.loads(run.stdout)
    assert [row["case"] for row in sides["cpu"]] == [row["case"] for row in sides["accelerator"]]
    assert all(row["steps_bytes"] > 0 for row in sides["accelerator"])
    for on_cpu, on_accelerator in zip(sides["cpu"], sides["accelerator"], strict=True):
        assert on_accelerator["figures"] == on_cpu["figures"], on_cpu["case"]
