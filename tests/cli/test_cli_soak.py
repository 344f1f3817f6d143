"""batchfit find --soak and batchfit tokens --soak: the answer for a run through the allocator model, and bad input
in one line before any trial."""

from __future__ import annotations

import json

import pytest

from cli_runner import invoke
from cli_runner import refused

FIND = ["find", "gpt-tiny", "--seq-len", "16", "--device", "sim:12MiB:cuda"]


def test_find_soak_prints_the_run_and_writes_it_beside_the_fresh_answer(tmp_path):
    out = tmp_path / "find.json"
    result = invoke(*FIND, "--soak", "50", "--eval-every", "10", "--json", str(out))
    assert result.exit_code == 0, result.output
    soak = json.loads(out.read_text())["soak"]
    assert soak["unit"] == "samples per batch" and soak["soaked"] <= soak["fresh"]
    assert json.loads(out.read_text())["batch_size"] == soak["soaked"]  # the answer given is the soaked one
    assert f"Soak of 50 steps: {soak['soaked']} samples per batch held every step" in result.output
    assert "expandable segments are not available beside vLLM's allocator" in result.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--eval-every", "10"], "--eval-every says when a soak evaluates: give --soak too"),
        (["--soak", "0"], "soak steps must be at least 1, got 0"),
    ],
)
def test_find_soak_settings_that_cannot_work_are_one_line(flags, message):
    refused(invoke(*FIND, *flags), message)


def test_a_soak_needs_the_allocator_model():
    result = invoke("find", "gpt-tiny", "--seq-len", "16", "--device", "sim:12MiB", "--soak", "50")
    refused(result, "a soak replays the caching allocator model, and sim:12.0MiB has none")


def test_tokens_soak_needs_lengths_and_lengths_need_a_soak(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("8\n12\n16\n")
    tokens = ["tokens", "lm-tiny", "--buckets", "8,16", "--device", "sim:12MiB:cuda"]
    refused(invoke(*tokens, "--soak", "100"), "--lengths")
    refused(invoke(*tokens, "--lengths", str(lengths)), "--soak")
