"""``optimal --checkpointing`` and ``plan --checkpointing``: bad input is one line and exit 2, before any work;
a plan by the frontier writes its choice and a split of the global batch."""

from __future__ import annotations

import json

import pytest

from cli_runner import invoke
from cli_runner import refused


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("optimal", "gpt-tiny", "--checkpointing", "bogus"), ("unknown activation-checkpointing policy", "full:K")),
        (("optimal", "gpt-tiny", "--checkpointing", "full:0"), ("full:0",)),
        (("optimal", "gpt-tiny", "--checkpointing", "auto", "--noise-scale", "100"), ("--noise-scale",)),
        (("optimal", "gpt-tiny", "--checkpointing", "auto", "--max-seconds", "5"), ("--max-seconds",)),
        (("plan", "gpt-tiny", "--checkpointing", "auto"), ("--global-batch-size",)),
        (("plan", "--checkpointing", "auto", "--global-batch-size", "64"), ("WORKLOAD",)),
        (
            ("plan", "llama-3-8b", "--gpus", "2", "--gpu", "h100-80gb", "--checkpointing", "auto"),
            ("--activation-checkpointing",),
        ),
    ],
)
def test_bad_checkpointing_input_is_one_line(args, words) -> None:
    refused(invoke(*args), *words)


def test_a_policy_the_model_cannot_take_is_one_line() -> None:
    refused(invoke("optimal", "mlp", "--device", "sim:64MiB", "--checkpointing", "none,hf"), "Hugging Face")


@pytest.mark.slow
def test_plan_by_the_frontier_on_a_trace_writes_the_choice_and_an_exact_split(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = invoke(
        "plan", "gpt-tiny", "--seq-len", "64", "--gpu", "rtx4090-24gb", "--global-batch-size", "65536",
        "--checkpointing", "none,full", "--json", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    frontier, plan = document["activation_checkpointing"], document["batch_configuration"]
    assert [p["policy"] for p in frontier["policies"]] == ["none", "full"] and not frontier["timed"]
    largest = {p["policy"]: p["largest_batch_size"] for p in frontier["policies"]}
    assert largest["full"] > largest["none"] > 0
    choice = frontier["choice"]
    assert plan["per_gpu_batch_size"] == choice["micro_batch_size"] <= largest[choice["policy"]]
    assert plan["per_gpu_batch_size"] * plan["gradient_accumulation_steps"] == 65536
