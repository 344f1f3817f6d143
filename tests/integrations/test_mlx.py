"""The MLX backend on the Linux CPU: linear peaks, the edge against a linear scan, bitwise restore,
and results and plans shaped exactly like torch's. Skipped, with one reason, where MLX is missing."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason='MLX is not installed: pip install "batchfit[mlx]"')

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

import batchfit as bf
from batchfit.integrations.mlx import MLX_OOM_MESSAGES
from batchfit.integrations.mlx import MlxDevice
from batchfit.integrations.mlx import MlxProber
from batchfit.integrations.mlx import MlxWorkload
from batchfit.integrations.mlx import find_max_batch_size
from batchfit.integrations.mlx import is_mlx_oom
from batchfit.integrations.mlx import probe_batch_size
from batchfit.integrations.mlx import resolve_mlx_device
from batchfit.integrations.mlx.batch import resize_batch
from batchfit.search.runner import search_workload
from batchfit.search.strategies import Binary
from batchfit.search.strategies import SearchSpace
from batchfit.step.builtin_workloads import mlp
from strategy_harness import run_strategy

# One worker builds the module's shared fixture once under pytest-xdist (--dist loadgroup), not once per worker.
pytestmark = pytest.mark.xdist_group("mlx")

OOM_MESSAGE = "[malloc] Unable to allocate 4294967296 bytes."  # as MLX's allocator raises it


class SmallMLP(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.layers = [nn.Linear(features, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, classes)]
        self.dropout = nn.Dropout(dropout)

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers[:-1]:
            x = self.dropout(nn.relu(layer(x)))
        return self.layers[-1](x)


def cross_entropy(logits: mx.array, labels: mx.array) -> mx.array:
    return nn.losses.cross_entropy(logits, labels, reduction="mean")


def small(optimizer: optim.Optimizer | None = None, loss_fn=cross_entropy, **model_options) -> MlxWorkload:
    mx.random.seed(0)
    sample = (mx.random.normal((8, 32)), mx.random.randint(0, 10, (8,)))
    return MlxWorkload(SmallMLP(**model_options), sample, loss_fn, optimizer or optim.Adam(learning_rate=1e-3))


def oom_above(limit: int):
    """A loss that fails as MLX does on Metal when the batch is over ``limit`` rows (MLX on the CPU crashes instead)."""

    def loss(logits: mx.array, labels: mx.array) -> mx.array:
        if logits.shape[0] > limit:
            raise RuntimeError(OOM_MESSAGE)
        return cross_entropy(logits, labels)

    return loss


def test_the_peak_is_linear_in_batch_size_and_includes_the_state_held():
    work = small()
    sizes = [640, 960, 1280, 1600, 1920]  # where activations set the peak: below ~300 it is the optimizer step
    with MlxProber(work, MlxDevice("256MiB")) as prober:
        trials = [prober.probe(size) for size in sizes]
    peaks = np.array([t.peak_bytes for t in trials], dtype=float)
    slope, intercept = np.polyfit(sizes, peaks, 1)
    residuals = np.abs(peaks - (slope * np.array(sizes) + intercept)) / peaks
    assert slope > work.bytes_per_sample() and residuals.max() < 0.03, (slope, residuals)
    parameter_bytes = sum(v.nbytes for _, v in tree_flatten(work.model.parameters()))
    for trial in trials:  # Adam: parameters, m and v are held at the start of step 2, and the peak counts them
        assert trial.steps == 2 and trial.peak_bytes > trial.held_bytes >= 3 * parameter_bytes


def test_a_peak_counts_what_was_live_at_the_reset_although_mlx_resets_its_own_to_zero():
    device = MlxDevice("64MiB")
    held = mx.ones((1 << 18,))
    mx.eval(held)
    device.reset_peak()
    assert mx.get_peak_memory() < held.nbytes <= device.live_bytes() <= device.peak_bytes()


@pytest.fixture(scope="module")
def linear_scan() -> tuple[int, int, int]:
    """A capacity whose edge is near 700, where activations set the peak (below ~300 it is the optimizer
    step's, and MLX's run-ahead makes it bimodal there), and where a linear scan first failed and last
    fitted. The peak only grows with the batch, so after checking that 1, 160, 640 and 672 fit the
    scan runs 672, 673, 674, ... (672 is the edge less the noise the test allows, 700 // 25) and goes
    on past the first failure, as peaks are noisy."""
    work = small()
    with MlxProber(work, MlxDevice("256MiB")) as prober:
        capacity = prober.probe(700).peak_bytes
    with MlxProber(work, MlxDevice(capacity), limit_bytes=capacity) as prober:
        assert all(prober.probe(size).fits for size in (1, 160, 640, 672))
        scan, size = {}, 672
        while sum(not fits for fits in scan.values()) < 8:
            scan[size] = prober.probe(size).fits
            size += 1
    return capacity, min(b for b, fits in scan.items() if not fits), max(b for b, fits in scan.items() if fits)


@pytest.mark.parametrize("strategy", ["auto", "power", "binary", "grow"])
def test_the_search_lands_on_the_edge_a_linear_scan_finds(strategy, linear_scan):
    capacity, first_fail, last_fit = linear_scan
    result = search_workload(small(), device=MlxDevice(capacity), strategy=strategy, max_batch_size=1500)
    tried = {t.batch_size: t.fits for t in result.trials}
    assert result.exact and tried[result.batch_size] and not tried[result.batch_size + 1]
    # MLX dispatches ahead of the computation, so peaks vary by about one intermediate array: the scan's
    # own band (sizes that both fitted and failed) and the search agree within that.
    noise = max(4, first_fail // 25)
    assert last_fit - (first_fail - 1) <= noise, (first_fail, last_fit)
    assert first_fail - 1 - noise <= result.batch_size <= last_fit + noise, (result.batch_size, first_fail, last_fit)
    assert result.strategy == ("power" if strategy == "auto" else strategy)  # auto is doubling, then bisection, on MLX


def test_an_mlx_allocation_failure_is_an_oom_and_the_edge_and_every_size_tried_are_exact():
    result = find_max_batch_size(
        SmallMLP(),
        small().sample_batch,
        loss_fn=oom_above(37),
        optimizer=optim.SGD(0.1),
        device="mlx:1GiB",
        strategy="binary",
        max_batch_size=100,
    )
    expected, answer = run_strategy(Binary(), SearchSpace(1, 100), lambda b: b <= 37)
    assert [t.batch_size for t in result.trials] == expected and result.batch_size == answer == 37
    failed = [t for t in result.trials if not t.fits]
    assert failed and all(t.oom and t.error == OOM_MESSAGE and t.peak_bytes is None for t in failed)


def test_only_mlx_out_of_memory_errors_count():
    assert all(is_mlx_oom(RuntimeError(f"{message} 8 bytes")) for message in MLX_OOM_MESSAGES)
    assert not is_mlx_oom(RuntimeError("out of memory"))
    assert not is_mlx_oom(ValueError(OOM_MESSAGE))
    assert not is_mlx_oom(MemoryError())


def state_bits(work: MlxWorkload) -> dict:
    def bits(tree):
        return [
            (path, value.dtype, np.array(mx.view(value.reshape(-1), mx.uint8))) for path, value in tree_flatten(tree)
        ]

    return {
        "parameters": bits(work.model.parameters()),
        "optimizer": bits(work.optimizer.state),
        "rng": bits([mx.random.state[0]]),
        "training": [m.training for m in work.model.modules()],
    }


def assert_same(before: dict, after: dict) -> None:
    assert before["training"] == after["training"]
    for key in ("parameters", "optimizer", "rng"):
        assert [(p, d) for p, d, _ in before[key]] == [(p, d) for p, d, _ in after[key]]
        assert all(np.array_equal(a, b) for (_, _, a), (_, _, b) in zip(before[key], after[key], strict=True)), key


class Boom(Exception):
    pass


def test_state_is_restored_bitwise_after_trials_an_oom_and_any_other_error():
    calls, boom_at = [], []

    def loss(logits, labels):
        calls.append(1)
        if logits.shape[0] > 300:
            raise RuntimeError(OOM_MESSAGE)
        if boom_at and len(calls) == boom_at[0]:
            raise Boom("not an OOM")
        return cross_entropy(logits, labels)

    work = small(optim.AdamW(learning_rate=1e-2), loss, dropout=0.5)  # dropout draws from the global RNG
    work.model.layers[1].eval()
    loss_and_grad = nn.value_and_grad(work.model, work.loss)
    _, grads = loss_and_grad(work.model, work.sample_batch)
    work.optimizer.update(work.model, grads)  # real optimizer state (step 1, m, v) to restore
    mx.eval(work.model.parameters(), work.optimizer.state)
    before = state_bits(work)
    result = search_workload(work, device=MlxDevice("64MiB"), max_batch_size=400)
    assert result.oom_trials >= 1
    assert_same(before, state_bits(work))
    boom_at.append(len(calls) + 2)  # in step 2 of the next trial, after step 1 changed everything
    with pytest.raises(Boom), MlxProber(work, MlxDevice("64MiB")) as prober:
        prober.probe(64)
    assert_same(before, state_bits(work))


def test_a_fresh_optimizer_stays_uninitialised():
    optimizer = optim.Adam(learning_rate=1e-3)
    keys = set(optimizer.state)
    probe_batch_size(
        SmallMLP(), small().sample_batch, 32, loss_fn=cross_entropy, optimizer=optimizer, device="mlx:64MiB"
    )
    assert set(optimizer.state) == keys and not optimizer._initialized


Pair = namedtuple("Pair", ["left", "right"])


@dataclass
class Nested:
    pair: Pair
    scale: mx.array
    tag: str


def test_batches_of_any_nesting_cycle_their_rows():
    sample = {
        "nested": Nested(Pair(mx.arange(3), mx.arange(6).reshape(3, 2)), mx.array(2.0), "t"),
        "ids": [mx.arange(3)],
    }
    batch = resize_batch(sample, 5)
    assert batch["nested"].pair.left.tolist() == [0, 1, 2, 0, 1] and batch["ids"][0].tolist() == [0, 1, 2, 0, 1]
    assert batch["nested"].pair.right.tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert batch["nested"].scale.item() == 2.0 and batch["nested"].tag == "t"
    step = lambda model, b: (model(b["nested"].pair.right.astype(mx.float32)) * b["nested"].scale).mean()  # noqa: E731
    trial = probe_batch_size(nn.Linear(2, 1), sample, 7, step_fn=step, device="mlx:16MiB")
    assert trial.fits and trial.steps == 2


def test_the_result_json_and_the_plan_are_shaped_like_torchs():
    mlx_result = search_workload(small(), device="mlx:2MiB", max_batch_size=200)
    torch_result = search_workload(mlp(), device="sim:8MiB", trace=False)
    mlx_dict, torch_dict = mlx_result.to_dict(), torch_result.to_dict()
    assert set(mlx_dict) == set(torch_dict) - {"lines"}  # the storages' lines: only a device counting storages
    assert {key for t in mlx_dict["trials"] for key in t} == {key for t in torch_dict["trials"] for key in t}
    plans = [
        bf.plan_batch(
            micro_batch_size=r.batch_size,
            global_batch_size=4096,
            devices=2,
            base_lr=3e-4,
            base_batch_size=256,
            dataset_size=100_000,
            epochs=3,
        ).to_dict()
        for r in (mlx_result, torch_result)
    ]
    assert set(plans[0]) == set(plans[1]) and set(plans[0]["batch_configuration"]) == set(
        plans[1]["batch_configuration"]
    )


def test_capacity_is_given_off_apple_silicon_and_must_fit_the_machine():
    if mx.metal.is_available():
        pytest.skip("Metal is available: MlxDevice() reads its recommended working set")
    with pytest.raises(ValueError, match="give a capacity"):
        MlxDevice()
    with pytest.raises(ValueError, match="more than this machine has"):
        MlxDevice(1 << 50)
    auto = resolve_mlx_device("auto")
    assert auto.simulated and auto.capacity_bytes() == 256 << 20 and auto.name == "mlx:cpu:256.0MiB"
    with pytest.raises(ValueError, match="for MLX use"):
        resolve_mlx_device("cuda:0")


def test_an_mlx_library_result_validates_against_the_shipped_schema():
    import json
    from importlib import resources

    jsonschema = pytest.importorskip("jsonschema")
    result = search_workload(small(), device="mlx:2MiB", max_batch_size=200)
    schema = json.loads(resources.files("batchfit").joinpath("search/schemas/search_result.schema.json").read_text())
    jsonschema.validate(json.loads(json.dumps(result.to_dict())), schema)
    assert result.max_batch_size == result.upper_bound == 200 and result.strategy == "power"
    assert all(trial.summary().startswith(f"batch size {trial.batch_size}: ") for trial in result.trials)
