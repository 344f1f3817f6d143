"""The soak: a run of many steps through the caching allocator model, checked against the run written by hand on a
fresh ``SimulatedDevice(capacity, allocator="cuda")`` (tests/support/soak_loops.py), and its bad inputs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import batchfit as bf
from batchfit.bounds import MOST_STEPS
from batchfit.devices.allocator_soak import SoakPlan
from batchfit.devices.allocator_soak import soak
from batchfit.errors import InputError
from batchfit.search.soak import MOST_SOAK_STEPS
from batchfit.search.soak import SoakSettings
from batchfit.search.soak import log_step
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.builtin_workloads import next_token_loss
from batchfit.tokens.budget import token_budget_of_workload
from batchfit.tokens.length_data import LengthSample
from batchfit.tokens.samples import at_length
from batchfit.tokens.soak import soak_token_budget
from batchfit.tokens.soak import token_plan
from hf_models import Size
from hf_models import gpt2
from hf_models import workload
from soak_loops import allocator_requests
from soak_loops import as_served
from soak_loops import hand_run
from soak_loops import token_batch

SKEWED = np.clip(np.random.default_rng(1).lognormal(2.2, 0.6, 2000).astype(int), 2, 32).tolist()  # most short


def _mlp_workload() -> bf.Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
    sample = (torch.randn(4, 64), torch.randint(0, 10, (4,)))
    return bf.Workload(model, sample, torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters()))


def test_a_fixed_shape_repeats_and_the_shortcut_reads_the_same_run_as_every_step_replayed():
    device = bf.SimulatedDevice("8MiB", allocator="cuda")
    log = log_step(_mlp_workload(), device, 100)
    evals = log_step(bf.Workload(**{**_mlp_workload().__dict__, "mode": "eval"}), device, 100)
    short = soak({"a": log}, SoakPlan(("a",) * 300, 30, ("e",) * 3), 8 * 2**20, start=log.start, eval_logs={"e": evals})
    # two names for one log: no shortcut, every step replayed
    plan = SoakPlan(("a", "b") * 150, 30, ("e",) * 3)
    whole = soak({"a": log, "b": log}, plan, 8 * 2**20, start=log.start, eval_logs={"e": evals})
    assert short.served and whole.served and short.repeated_from_step is not None and whole.repeated_from_step is None
    assert short.reserved_bytes == whole.reserved_bytes and short.retries == whole.retries
    assert whole.replayed_steps == 300 > short.replayed_steps
    large = log_step(_mlp_workload(), device, 1000)  # its activations need a segment of the large pool
    tight = soak({"a": large}, SoakPlan(("a",) * 10), large.start.stats.reserved_bytes, start=large.start)
    assert (tight.served, tight.failed_step, tight.failed_shape, tight.steps_run) == (False, 1, "a", 0)


def test_the_hand_written_run_holds_at_the_soaked_budget_and_fails_where_the_soak_said_at_the_fresh_one():
    # gpt-tiny of one layer, lengths mostly short with a long tail, an evaluation pass every 10 steps: from an
    # emptied cache 312 tokens per micro-batch fit every bucket; over the run the cache left by other shapes binds.
    device = bf.SimulatedDevice("10MiB", allocator="cuda")
    work = gpt_tiny(seq_len=32, layers=1)
    budget = token_budget_of_workload(work, [8, 16, 32], device=device, packed=False, accumulating=False)
    settings = SoakSettings(steps=40, eval_every_steps=10)
    run = soak_token_budget(work, budget, SKEWED, settings, device=device)
    soaked = run.soaked
    assert soaked.budget < soaked.fresh and soaked.fresh_run.failed_step is not None
    sample = LengthSample.of(SKEWED)

    def by_hand(tokens: int) -> int | None:
        plan = token_plan(tokens, run.buckets, sample, settings)
        fresh = gpt_tiny(seq_len=32, layers=1)
        shapes = [key[1:] for key in plan.train]
        evals = [key[1:] for key in plan.eval_shapes]
        return hand_run(
            fresh.model,
            fresh.optimizer,
            next_token_loss,
            token_batch(512),
            shapes,
            10 * 2**20,
            eval_every=10,
            evals=evals,
        )

    assert by_hand(soaked.budget) is None
    assert abs(by_hand(soaked.fresh) - soaked.fresh_run.failed_step) <= 2
    document = json.loads(json.dumps(run.to_dict()))
    assert document["soaked"] == soaked.budget and document["fresh"] == soaked.fresh
    assert "binds" not in document["binding"] or str(document["buckets"][-1]) in document["binding"]
    assert "vLLM" in document["advice"]


def test_the_soak_replays_the_very_requests_of_a_hand_written_gpt2_run_its_tied_weight_placed_once():
    # GPT-2's lm_head.weight is its wte.weight: model.to(device) meets it twice and copies it once. Copied twice
    # (and the first copy freed), the hand-written run had a hole among the parameters that no real run has: at
    # the benchmark's 424 tokens it ran out of memory at step 114 where the soak held, at 440 at step 12, not 2.
    capacity, size = 12 * 2**20, Size(64, 2, 2, 256, 256, 32)
    work = dataclasses.replace(workload(gpt2, size, "gpt2"), accumulating=False)
    for tokens, settings, failed_step in (
        (424, SoakSettings(steps=16, eval_every_steps=8, eval_steps=2), None),  # the soaked budget: it holds
        (440, SoakSettings(steps=3), 2),  # the fresh-cache one: the soak says step 2
    ):
        plan = token_plan(tokens, [8, 16, 32], LengthSample.of(SKEWED), settings)
        device = bf.SimulatedDevice(capacity, allocator="cuda")  # its first trial starts as the hand-written run

        def log(key: tuple, mode: str, device=device):
            shaped = dataclasses.replace(work, sample_batch=at_length(work.sample_batch, key[2]), mode=mode)
            return log_step(shaped, device, key[1])

        train = {key: log(key, "train") for key in dict.fromkeys(plan.train)}
        evals = {key: log(key, "eval") for key in dict.fromkeys(plan.eval_shapes)}
        start = next(iter(train.values())).start
        with allocator_requests() as replayed:
            run = soak(train, plan, capacity, start=start, eval_logs=evals)
        fresh = workload(gpt2, size, "gpt2")
        with allocator_requests() as by_hand:
            reached = hand_run(
                fresh.model,
                fresh.optimizer,
                None,
                token_batch(size.vocab, mapping=True),
                [key[1:] for key in plan.train],
                capacity,
                eval_every=settings.eval_every_steps,
                evals=[key[1:] for key in plan.eval_shapes],
            )
        assert (run.failed_step, reached) == (failed_step, failed_step)
        placed = len(start.active)  # model.to(device): each parameter once, where the soak's start holds them
        by_address = sorted(start.active, key=lambda block: block.ptr)
        assert by_hand[:placed] == [
            ("malloc", asked, block.ptr) for (_, asked, _), block in zip(by_hand[:placed], by_address, strict=True)
        ]
        # then every request and free of every step and evaluation pass, at the very addresses; then only frees
        assert as_served(by_hand[placed : placed + len(replayed)]) == as_served(replayed)
        assert {kind for kind, _, _ in by_hand[placed + len(replayed) :]} == {"free"}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(steps=0), "soak steps must be at least 1"),
        (dict(steps=MOST_SOAK_STEPS + 1), "soak steps must be at most"),
        (dict(eval_every_steps=0), "eval_every_steps"),
        (dict(eval_steps=0), "eval_steps"),
    ],
)
def test_bad_soak_settings_are_one_line(settings, message):
    with pytest.raises(InputError, match=message):
        SoakSettings(**settings)
    assert MOST_SOAK_STEPS > MOST_STEPS


def test_a_device_without_the_allocator_model_is_refused_before_any_trial():
    work = _mlp_workload()
    with pytest.raises(InputError, match="sim:8GiB:cuda"):
        bf.find_max_batch_size(
            work.model,
            work.sample_batch,
            loss_fn=work.loss_fn,
            optimizer=work.optimizer,
            device="sim:8MiB",
            soak_steps=10,
        )
    with pytest.raises(InputError, match="give soak_steps too"):
        bf.find_max_batch_size(
            work.model, work.sample_batch, loss_fn=work.loss_fn, device="sim:8MiB", eval_every_steps=10
        )


def test_find_answers_for_the_run_and_keeps_the_fresh_answer_beside_it():
    work = _mlp_workload()
    result = bf.find_max_batch_size(
        work.model,
        work.sample_batch,
        loss_fn=work.loss_fn,
        optimizer=work.optimizer,
        device="sim:3MiB:cuda",
        soak_steps=100,
        eval_every_steps=20,
    )
    document = result.extra["soak"]
    assert result.batch_size == document["soaked"] <= document["fresh"] and document["held"]["steps_run"] == 100


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is empty"),
        ("128\nabc\n", "line 2 of"),
        ("[1, 2.5]", "item 2 of"),
        ("{bad", "not valid JSON"),
        ("0\n", "at least 1"),
    ],
)
def test_bad_lengths_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        LengthSample.of(path)
    with pytest.raises(InputError, match="not found"):
        LengthSample.of(tmp_path / "missing.txt")


def test_lengths_read_as_lines_json_lists_and_histograms(tmp_path):
    lines, listed, histogram = (tmp_path / name for name in ("a.txt", "b.json", "c.json"))
    lines.write_text("5\n5\n40\n")
    listed.write_text("[5, 5, 40]")
    histogram.write_text('{"5": 2, "40": 1}')
    assert (
        LengthSample.of(lines) == LengthSample.of(listed) == LengthSample.of(histogram) == LengthSample((5, 40), (2, 1))
    )
