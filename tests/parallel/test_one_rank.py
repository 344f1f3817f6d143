"""Real trials of one rank at world size N over torch's fake process group (batchfit.parallel.one_rank)."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import torch
import torch.distributed as dist

import batchfit as bf
from batchfit.devices.simulated import SimulatedDevice
from batchfit.devices.trace import TraceDevice
from batchfit.errors import InputError
from batchfit.parallel import Parallelism
from batchfit.parallel import trace_rank
from batchfit.parallel.one_rank import RankProber
from batchfit.parallel.one_rank import RankWorkload
from batchfit.parallel.one_rank import find_rank_batch_size
from batchfit.parallel.one_rank import probe_rank_batch_size
from batchfit.parallel.world import fake_world
from batchfit.parallel.wrap import shard_model
from fsdp_cases import CASES
from fsdp_cases import SMALL_LLAMA

SCHEMA = resources.files("batchfit").joinpath("search/schemas/search_result.schema.json")
pytestmark = [
    pytest.mark.filterwarnings("ignore:DTensor random operators"),
    pytest.mark.filterwarnings(
        "ignore:`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    ),
]


@pytest.mark.parametrize(
    ("name", "world_size"),
    [("tiny", 2), pytest.param("llama_checkpointed", 4, marks=pytest.mark.slow)],  # 2.5 s: make reliability
)
def test_one_ranks_real_trial_peaks_where_the_fake_trace_does(name: str, world_size: int) -> None:
    """The same rank, the same step: real tensors over the fake group (only its shards built) and
    the fake-tensor trace agree to the byte (a transformers batch's labels a tensor of their own in both)."""
    case = CASES[name]
    parallelism = case.parallelism(world_size, rank=world_size - 1)
    trial = probe_rank_batch_size(
        case.spec(), case.seq_len, case.batch_size, parallelism=parallelism, device="sim:256MiB"
    )
    fake = trace_rank(case.spec(), case.batch_size, case.seq_len, parallelism=parallelism)
    assert trial.fits and trial.steps == 2
    assert trial.peak_bytes == fake.peak_bytes
    assert not dist.is_initialized()  # the fake world is gone


def test_the_search_lands_on_the_edge_that_single_trials_confirm() -> None:
    """The whole sequence of sizes tried, and the answer checked by probing it and the size above
    in fresh worlds."""
    parallelism = Parallelism(world_size=4)
    device = SimulatedDevice("4MiB")
    result = find_rank_batch_size(SMALL_LLAMA | {"model_type": "llama"}, 16, parallelism=parallelism, device=device)
    sizes = [t.batch_size for t in result.trials]
    assert sizes[:2] == [2, 3]
    assert result.exact and result.batch_size == max(t.batch_size for t in result.trials if t.fits)
    assert result.extra["mode"].startswith("one rank of 4, real trials")
    spec = SMALL_LLAMA | {"model_type": "llama"}
    at = probe_rank_batch_size(spec, 16, result.batch_size, parallelism=parallelism, device=device)
    above = probe_rank_batch_size(spec, 16, result.batch_size + 1, parallelism=parallelism, device=device)
    assert at.fits and not above.fits
    assert not dist.is_initialized()


def test_only_this_ranks_shards_are_allocated() -> None:
    """At 4 ranks the rank holds a quarter of the parameters (FSDP2 pads shards to one size)."""
    work = RankWorkload(CASES["tiny"].spec(), 16, Parallelism(world_size=4))
    with RankProber(work, SimulatedDevice("64MiB"), steps=2, limit_bytes=None) as prober:
        local = sum(p.to_local().numel() for p in prober._prober.workload.model.parameters())
    whole = work.parameter_count()
    assert whole / 4 <= local <= whole / 4 + 4 * 64  # padding: at most a few rows per parameter


def test_an_error_in_the_users_optimizer_propagates_and_the_world_is_destroyed() -> None:
    def broken(params):
        raise ValueError("my optimizer is broken")

    work = RankWorkload(CASES["tiny"].spec(), 16, Parallelism(world_size=2), optimizer=broken)
    with (
        pytest.raises(ValueError, match="my optimizer is broken"),
        RankProber(work, SimulatedDevice("64MiB"), steps=2, limit_bytes=None),
    ):
        pass
    assert not dist.is_initialized()


def test_bad_inputs_are_one_line() -> None:
    tiny = CASES["tiny"].spec()
    with pytest.raises(InputError, match="DDP's reducer needs real collectives"):
        RankWorkload(tiny, 16, Parallelism(world_size=2, sharding="ddp"))
    with pytest.raises(InputError, match="rank must be an integer from 0 to world_size - 1 = 3"):
        Parallelism(world_size=4, rank=4)
    with fake_world(Parallelism(world_size=2)), pytest.raises(InputError, match="already initialised"):
        probe_rank_batch_size(tiny, 16, 1, parallelism=Parallelism(world_size=2), device="sim:64MiB")


def test_the_cli_runs_one_rank_and_says_what_it_measured(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama.json").write_text(json.dumps(SMALL_LLAMA | {"model_type": "llama"}))
    args = ["find", "llama.json", "--gpus", "2", "--device", "sim:4MiB", "--seq-len", "16", "--json", "out.json"]
    result = CliRunner().invoke(app, [*args, "--max-trials", "3"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "One rank, real trials" in result.output and "rank 0 of 2, FSDP2 full shard" in result.output
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["mode"].startswith("one rank of 2") and document["parallelism"]["world_size"] == 2
    jsonschema.validate(document, json.loads(SCHEMA.read_text()))
    assert [t["batch_size"] for t in document["trials"]][:2] == [2, 3]
    several = CliRunner().invoke(app, [*args[:6], "--activation-checkpointing", "none,full"])
    assert several.exit_code == 2 and "one activation-checkpointing choice at a time" in several.output
    bad_rank = CliRunner().invoke(app, [*args[:6], "--rank", "2"])
    assert bad_rank.exit_code == 2 and "rank must be an integer from 0 to world_size - 1 = 1" in bad_rank.output
    assert torch.distributed.is_initialized() is False


@pytest.mark.slow  # a plan traces its search, then two real trials: about 5 s of CPU
def test_plan_verify_confirms_the_traced_answer_with_real_trials_at_it_and_above(tmp_path, monkeypatch) -> None:
    """The traced micro-batch fits in one rank's real trial and the size above does not; the real
    peak is the fake one to the byte."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama.json").write_text(json.dumps(SMALL_LLAMA | {"model_type": "llama"}))
    args = ["plan", "llama.json", "--gpu", "4MiB", "--gpus", "2", "--seq-len", "16", "--global-batch-tokens", "1K"]
    args += ["--activation-checkpointing", "none", "--verify", "--json", "plan.json"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Verified on sim:4.0MiB" in result.output
    verification = json.loads((tmp_path / "plan.json").read_text())["sharding"]["verification"]
    at, above, *later = verification["rows"]
    if later:  # the plan accumulates: its micro-batch and the held largest fit as later micro-batches, one more not
        assert [row["fits"] for row in later] == [True] * (len(later) - 1) + [False]
        assert all(row["accumulating"] for row in later)
    assert above["batch_size"] == at["batch_size"] + 1
    assert at["fits"] and not above["fits"]
    assert at["difference_bytes"] == 0
    assert verification["mode"] == "one rank, real trials"
    refused = CliRunner().invoke(app, ["plan", "--micro-batch-size", "4", "--global-batch-size", "8", "--verify"])
    assert refused.exit_code == 2 and "--verify confirms a plan traced on fake tensors" in refused.output


@pytest.mark.slow  # a plan traces its search, then real trials at it, above it and below it: about 6 s of CPU
def test_plan_verify_replaces_a_traced_answer_that_fails_for_real(tmp_path, monkeypatch) -> None:
    """Traced for 4 MiB, verified on a 3.5 MiB device: the traced micro-batch fails its real trial, so the
    plan uses the largest size one rank's real trials fit below it, and says so."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama.json").write_text(json.dumps(SMALL_LLAMA | {"model_type": "llama"}))
    args = ["plan", "llama.json", "--gpu", "4MiB", "--gpus", "2", "--seq-len", "16", "--global-batch-tokens", "1K"]
    args += ["--activation-checkpointing", "none", "--verify", "--device", "sim:3584KiB", "--json", "plan.json"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "plan.json").read_text())
    at = document["sharding"]["verification"]["rows"][0]
    assert not at["fits"] and 1 <= at["verified_batch_size"] < at["batch_size"]
    assert f"the traced micro-batch {at['batch_size']} did not fit" in result.output
    assert document["batch_configuration"]["per_gpu_batch_size"] <= at["verified_batch_size"]
    spec = SMALL_LLAMA | {"model_type": "llama"}
    for size, fits in ((at["verified_batch_size"], True), (at["verified_batch_size"] + 1, False)):
        trial = probe_rank_batch_size(spec, 16, size, parallelism=Parallelism(world_size=2), device="sim:3584KiB")
        assert trial.fits is fits


def test_a_users_own_model_is_tried_as_one_rank_and_left_as_it_was() -> None:
    """find_max_batch_size/probe_batch_size with a parallelism: a sharded copy on meta, only the
    rank's shards allocated, the optimizer built again; the user's model, values and optimizer
    untouched, and the trial's peak the fake trace's of the same model to the byte."""
    import copy

    import batchfit as bf

    torch.manual_seed(0)
    model = CASES["tiny"].spec()()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, foreach=True)
    values = copy.deepcopy(model.state_dict())
    ids = torch.randint(0, 256, (2, 16))

    def loss_fn(logits, batch):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())

    parallelism = Parallelism(world_size=4, rank=1)
    options = {"loss_fn": loss_fn, "optimizer": optimizer, "parallelism": parallelism}
    trial = bf.probe_batch_size(model, ids, 3, device="sim:64MiB", **options)
    fake = trace_rank(CASES["tiny"].spec(), 3, 16, parallelism=parallelism)
    assert trial.peak_bytes == fake.peak_bytes
    result = bf.find_max_batch_size(model, ids, device=SimulatedDevice("2MiB"), **options)
    assert [t.batch_size for t in result.trials] == [2, 3, 6, 5]
    assert [t.fits for t in result.trials] == [True, True, False, True] and result.batch_size == 5
    assert result.extra["mode"].startswith("one rank of 4") and result.extra["parallelism"]["rank"] == 1
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert not any(hasattr(p, "device_mesh") for p in model.parameters()) and not dist.is_initialized()


def test_the_fake_groups_collectives_leave_finite_values_one_rank_trials_rely_on() -> None:
    """torch's fake process group copies this rank's input into every slice of an all-gather and
    a chunk of its input into a reduce-scatter's output: gathered parameters and reduced gradients
    hold finite values, never whatever memory held (if torch changes this, this test says so)."""
    with fake_world(Parallelism(world_size=4)):
        gathered = torch.full((8,), float("nan"))
        dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0]))
        reduced = torch.full((2,), float("nan"))
        dist.reduce_scatter_tensor(reduced, torch.arange(8.0))
    assert gathered.tolist() == [1.0, 2.0] * 4
    assert reduced.tolist() == [0.0, 1.0]


def _sharded_step(after_backward, scaler=None):
    """One forward and backward of a sharded tiny model at world size 2 (``scaler``: a GradScaler
    scales the loss), then ``after_backward(model, optimizer)``."""
    parallelism = Parallelism(world_size=2)
    with fake_world(parallelism) as mesh:
        model = shard_model(CASES["tiny"].spec()(), mesh, parallelism)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 256, (2, 16))
        loss = _token_loss(model(ids), ids)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return after_backward(model, optimizer)


def test_clipping_that_refuses_non_finite_gradients_passes_on_one_rank() -> None:
    def clip(model, optimizer):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)

    assert torch.isfinite(_sharded_step(clip).full_tensor())


def test_a_grad_scaler_takes_the_optimizer_step_on_one_rank() -> None:
    """A skipped step (inf found) would make no optimizer state, and a trial would under-count it."""
    scaler = torch.amp.GradScaler("cpu")

    def step(model, optimizer):
        scaler.step(optimizer)
        return len(optimizer.state)

    assert _sharded_step(step, scaler) == len(list(CASES["tiny"].spec()().parameters()))


def test_routing_on_values_runs_on_this_ranks_rows_repeated() -> None:
    """A gate that routes each token by the gathered weights' values (top-1 of two experts) runs;
    the gathered weights are this rank's rows in every slice (finite, but not the whole model's:
    routing, and so memory, can differ from the real run's)."""

    class Routed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16)
            self.gate = torch.nn.Linear(16, 2)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 64) for _ in range(2))

        def forward(self, ids):
            x = self.embed(ids)
            choice = self.gate(x).argmax(-1)
            out = torch.zeros(*ids.shape, 64)
            for index, expert in enumerate(self.experts):
                chosen = choice == index
                out[chosen] = expert(x[chosen])  # data-dependent shapes: the rows routed here
            return out

    work_ids = torch.randint(0, 64, (4, 8))
    trial = bf.probe_batch_size(
        Routed(), work_ids, 4, loss_fn=_token_loss, device="sim:64MiB", parallelism=Parallelism(world_size=2)
    )
    assert trial.fits and trial.steps == 2


def _token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_the_cli_runs_a_workload_of_ones_own_as_one_rank_and_plans_with_it(tmp_path, monkeypatch) -> None:
    """find and plan with --gpus on a built-in workload (not a config): its model copied and sharded."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    found = runner.invoke(app, ["find", "mlp", "--gpus", "4", "--device", "sim:8MiB", "--json", "out.json"])
    assert found.exit_code == 0, found.output
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["mode"].startswith("one rank of 4") and document["trials"][0]["batch_size"] == 2
    planned = runner.invoke(
        app, ["plan", "mlp", "--gpus", "4", "--device", "sim:8MiB", "--global-batch-size", "64"], env={"COLUMNS": "200"}
    )
    assert planned.exit_code == 0, planned.output
    assert "(one rank of 4, real trials" in planned.output and "x 4 device(s) = 64 samples" in planned.output
    estimated = runner.invoke(
        app, ["estimate", "mlp", "--gpus", "4", "--gpu", "h100-80gb", "--json", "e.json"], env={"COLUMNS": "200"}
    )
    assert estimated.exit_code == 0, estimated.output
    assert "One rank, traced on fake tensors (nothing allocated)" in estimated.output
    traced = json.loads((tmp_path / "e.json").read_text())
    assert traced["mode"].startswith("one rank of 4, traced on fake tensors") and traced["exact"]
    small = runner.invoke(app, ["find", "mlp", "--gpus", "2", "--device", "sim:4KiB"], env={"COLUMNS": "200"})
    assert small.exit_code == 2 and "one rank's share of 2" in small.output and "more ranks" in small.output


def test_a_users_own_model_traced_on_a_gpu_preset_agrees_with_its_real_trials() -> None:
    """With a TraceDevice the same search runs on fake tensors (nothing allocated): its answer and
    the peak of every size both searches tried are the real one rank's, to the byte."""
    model = CASES["tiny"].spec()()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    ids = torch.randint(0, 256, (2, 16))
    options = {"loss_fn": _token_loss_float, "optimizer": optimizer, "parallelism": Parallelism(world_size=4)}
    traced = bf.find_max_batch_size(model, ids, device=TraceDevice("2MiB"), **options)
    real = bf.find_max_batch_size(model, ids, device=SimulatedDevice("2MiB"), **options)
    assert traced.batch_size == real.batch_size == 5
    assert traced.extra["mode"].startswith("one rank of 4, traced on fake tensors")
    real_peaks = {t.batch_size: t.peak_bytes for t in real.trials if t.fits}
    traced_peaks = {t.batch_size: t.peak_bytes for t in traced.trials}
    assert real_peaks and all(traced_peaks[size] == peak for size, peak in real_peaks.items() if size in traced_peaks)
    assert {2, 5} <= real_peaks.keys() & traced_peaks.keys()
    assert not dist.is_initialized()


def _token_loss_float(logits, ids):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def test_a_hugging_face_model_of_ones_own_gets_the_same_answer_real_and_traced() -> None:
    """transformers' GPT-2 (a model batchfit did not write), in the loop a user writes (its own
    loss from labels, output alive through backward), as one rank of 4: real trials and the trace
    find the same micro-batch, and the sizes both ran peak at the same bytes."""
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, eos_token_id=0, bos_token_id=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (2, 32))
    options = {"optimizer": torch.optim.AdamW(model.parameters()), "parallelism": Parallelism(world_size=4)}
    batch = {"input_ids": ids, "labels": ids.clone()}
    real = bf.find_max_batch_size(model, batch, device=SimulatedDevice("8MiB"), **options)
    traced = bf.find_max_batch_size(model, batch, device=TraceDevice("8MiB"), **options)
    assert real.batch_size == traced.batch_size > 1
    real_peaks = {t.batch_size: t.peak_bytes for t in real.trials if t.fits}
    common = real_peaks.keys() & {t.batch_size for t in traced.trials}
    assert real.batch_size in common
    assert all(real_peaks[size] == next(t.peak_bytes for t in traced.trials if t.batch_size == size) for size in common)
