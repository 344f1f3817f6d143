"""The workflows a library user calls are what the commands run: the same searches in the same order, the
same plans and documents, with what they find said through a ``Progress``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import batchfit as bf
from batchfit.cli.app import app
from batchfit.cli.workloads import load_workload
from batchfit.parallel.copied import ShardedCopy
from batchfit.parallel.settings import Parallelism
from batchfit.planning.plan import plan_batch
from batchfit.search.runner import probe_workload
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.workflows.progress import Progress
from batchfit.workflows.rank_workloads import accumulating
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import route_workload
from batchfit.workflows.sharded_estimate import estimate_own_rank
from batchfit.workflows.sharded_plan import plan_sharded
from batchfit.workflows.workload_plan import plan_workload


class Recorded(Progress):
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.steps: list[str] = []

    def working(self, text: str):
        self.steps.append(text)
        return super().working(text)

    def said(self, line: str) -> None:
        self.lines.append(line)


def mlp_workload() -> bf.Workload:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return bf.Workload(
        model,
        torch.randn(2, 64),
        loss_fn=lambda out, batch: out.square().mean(),
        optimizer=torch.optim.Adam(model.parameters()),
    )


def test_a_plan_that_accumulates_measures_again_with_the_windows_gradients_held_and_plans_on_that():
    work, progress = mlp_workload(), Recorded()
    settings = SearchSettings(strategy="binary", trace=False)

    def planner(largest: int):
        return plan_batch(micro_batch_size=largest, global_batch_size=8192)

    found = plan_workload(work, planner, settings, device="sim:2MiB", progress=progress)
    one_step = search_workload(work, settings, device="sim:2MiB")  # what each search alone tries
    held = search_workload(accumulating(work), settings.replace(max_batch_size=one_step.batch_size), device="sim:2MiB")
    assert [t.batch_size for t in found.one_step.trials] == [t.batch_size for t in one_step.trials]
    assert [t.batch_size for t in found.held.trials] == [t.batch_size for t in held.trials]
    assert found.held.batch_size == held.batch_size < one_step.batch_size  # the held gradients take room
    assert found.plan == planner(held.batch_size) and found.search is found.held
    assert progress.lines == [
        f"Measured on sim:2.0MiB: the largest micro-batch is {one_step.batch_size}.",
        f"Measured on sim:2.0MiB with the accumulation window's gradients held: the largest micro-batch is "
        f"{held.batch_size}.",
    ]


def test_a_plan_in_one_micro_batch_searches_once():
    found = plan_workload(
        mlp_workload(), lambda largest: plan_batch(micro_batch_size=largest, global_batch_size=4), device="sim:2MiB"
    )
    assert found.held is None and found.plan.gradient_accumulation_steps == 1


def test_one_router_for_every_command():
    assert [route_workload(name, False) for name in ("gpt-tiny", "m.py:make", "llama-3-8b", "c/config.json")] == [
        Route.OWN,
        Route.OWN,
        Route.CONFIG,
        Route.CONFIG,
    ]
    assert route_workload("gpt-tiny", True) is Route.OWN_RANK and route_workload("llama-3-8b", True) is Route.CONFIG


def test_estimate_of_one_rank_at_a_batch_size_answers_at_that_size(tmp_path, monkeypatch):
    """``estimate WORKLOAD --gpus 2 --batch-size 8`` used to run the search and report the largest size's peak
    as if it were 8's: the question asked (does 8 fit, and at what peak) went unanswered."""
    monkeypatch.chdir(tmp_path)
    args = ["estimate", "gpt-tiny", "--capacity", "64MiB", "--gpus", "2", "--batch-size", "8", "--json", "e.json"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "e.json").read_text())
    work = ShardedCopy(load_workload("gpt-tiny"), Parallelism(world_size=2))
    at = probe_workload(work, 8, device=bf.TraceDevice("64MiB"))
    assert (document["batch_size"], document["fits"], document["peak_bytes"]) == (8, True, at.peak_bytes)
    assert document["largest_batch_size"] > 8 and document["estimate"]["peak_bytes"] == at.peak_bytes
    assert "Micro-batch 8 per rank fits: traced peak" in result.output
    found = estimate_own_rank(work, bf.TraceDevice("64MiB"), batch_size=8)
    assert found.at.peak_bytes == at.peak_bytes and found.search.batch_size == document["largest_batch_size"]


@pytest.mark.slow  # the sharded plan twice, by the library and by the command: about 5 s (make reliability)
def test_a_library_call_makes_the_sharded_plan_the_command_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["plan", "llama-tiny.json", "--gpu", "8MiB", "--gpus", "4", "--seq-len", "64"]
    args += ["--global-batch-tokens", "24K", "--json", "plan.json"]
    (tmp_path / "llama-tiny.json").write_text((Path(__file__).parents[2] / "examples/llama-tiny.json").read_text())
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    choices = [Parallelism(world_size=4, activation_checkpointing=choice) for choice in ("none", "full")]
    progress = Recorded()
    found = plan_sharded(
        "llama-tiny.json",
        "8MiB",
        64,
        choices,
        lambda largest: plan_batch(micro_batch_size=largest, global_batch_tokens=24 * 1024, seq_len=64, devices=4),
        progress=progress,
    )
    assert found.to_dict() == json.loads((tmp_path / "plan.json").read_text())
    assert all(line in result.output.replace("\n", " ") for line in progress.lines[:2])
    assert progress.steps[:2] == [f"Tracing one rank, activation checkpointing {c}" for c in ("none", "full")]


def test_find_takes_one_rank_of_a_parallelism_and_refuses_anything_else_in_one_line() -> None:
    model = torch.nn.Linear(16, 16)
    batch = torch.randn(4, 16)
    options = {"loss_fn": lambda out, batch: out.square().mean(), "optimizer": torch.optim.SGD(model.parameters())}
    with pytest.raises(bf.InputTypeError, match="parallelism must be a batchfit.parallel.Parallelism"):
        bf.find_max_batch_size(model, batch, device="sim:1MiB", parallelism={"world_size": 2}, **options)
    one = bf.probe_batch_size(model, batch, 4, device="sim:1MiB", **options)
    ranked = bf.probe_batch_size(model, batch, 4, device="sim:1MiB", parallelism=Parallelism(world_size=4), **options)
    assert one.fits and ranked.fits
    assert ranked.held_bytes < one.held_bytes  # a quarter of the parameters, gradients and optimizer state per rank
