"""batchfit estimate for a model built from its config, per rank under FSDP2 (the sharded path)."""

from __future__ import annotations

import json

import pytest

from batchfit.parallel.models import LLM_PRESETS
from cli_runner import invoke
from fsdp_cases import SMALL_LLAMA

CAPACITY = "6MiB"  # a small Llama at sequence 64 fits a few samples per rank in this
WANTED = 5  # a micro-batch between the largest without checkpointing and the largest with it


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps({**LLM_PRESETS["llama-3-8b"], **SMALL_LLAMA}))
    return str(path)


@pytest.mark.slow  # the README's per-rank estimate commands print the same figures in every make test
def test_a_config_file_at_two_ranks_writes_the_per_rank_figures_and_names_what_reaches_a_micro_batch(
    small_llama, tmp_path
):
    out = tmp_path / "est.json"
    args = ["--capacity", CAPACITY, "--gpus", "2", "--seq-len", "64", "--activation-checkpointing", "none,full"]
    result = invoke("estimate", small_llama, *args, "--batch-size", str(WANTED), "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "rank 0 of 2, FSDP2 full shard" in result.output and "No GPU has checked" in result.output
    document = json.loads(out.read_text())
    assert document["world_size"] == 2 and sum(document["breakdown"].values()) == document["peak_bytes"]
    none, full = document["choices"]
    assert document["largest_batch_size"] == none["largest_batch_size"] > 0
    for choice in (none, full):  # the answer's trace fits; the trace one above does not
        search = choice["search"]
        assert search["estimate"]["peak_bytes"] <= search["capacity_bytes"] < search["above"]["peak_bytes"]
        assert search["estimate"]["batch_size"] + 1 == search["above"]["batch_size"] == choice["largest_batch_size"] + 1
        assert choice["estimate"]["batch_size"] == WANTED  # the breakdown is at the micro-batch asked for
    # recomputing blocks frees activations: only full checkpointing reaches the micro-batch asked for
    assert none["largest_batch_size"] < WANTED <= full["largest_batch_size"]
    assert f"Micro-batch {WANTED} per rank fits with activation checkpointing full." in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-3-8b", "--gpus", "0"], "--gpus must be at least 1, got 0"),
        (["llama-3-8b", "--gpus", "6", "--hybrid-shard", "--gpus-per-node", "4"], "world_size 6 is not a multiple"),
        (["llama-3-8b", "--nodes", "2"], "--nodes needs --gpus-per-node"),
        (["llama-9b", "--gpus", "8"], "unknown model 'llama-9b': give one of llama-3-8b"),
        (["llama-3-8b", "--activation-checkpointing", "some"], "must be 'none' or 'full' or 'selective'"),
    ],
)
def test_bad_sharded_inputs_are_one_line(args, message):
    result = invoke("estimate", *args, "--gpu", "h100-80gb")
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_a_file_that_is_not_a_model_config_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"foo": 1}')
    result = invoke("estimate", str(path), "--gpu", "h100-80gb", "--gpus", "8")
    assert result.exit_code == 2 and "is not a model config" in result.stderr


def test_a_sharded_plan_takes_the_micro_batch_per_rank_and_advises_checkpointing(small_llama, tmp_path):
    out = tmp_path / "plan.json"
    args = ["--gpu", CAPACITY, "--nodes", "2", "--gpus-per-node", "2", "--seq-len", "64"]
    result = invoke("plan", small_llama, *args, "--global-batch-tokens", "8K", "--json", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    config, sharding = document["batch_configuration"], document["sharding"]
    none, full = sharding["per_rank"]
    assert sharding["activation_checkpointing"] == "none" and sharding["parallelism"]["world_size"] == 4
    assert config["per_gpu_batch_size"] <= none["largest_batch_size"] < full["largest_batch_size"]
    assert config["devices"] == 4 and config["total_batch_tokens"] == 8192 == 2**13  # 8K tokens, as papers count
    steps = config["gradient_accumulation_steps"]
    assert config["per_gpu_batch_size"] * steps * 4 * 64 == 8192 and steps > 1
    assert "With the window's gradient shards held" in result.output  # measured again for accumulation
    assert any(advice.startswith("activation checkpointing full fits") for advice in document["advice"])


def test_a_sharded_plan_needs_a_gpu_preset_or_size():
    result = invoke("plan", "llama-3-8b", "--gpus", "8", "--global-batch-tokens", "4M")
    assert result.exit_code == 2 and "give --gpu (e.g. --gpu h100-80gb)" in result.stderr
    result = invoke("plan", "llama-3-8b", "--gpus", "8", "--gpu", "h200-9000")
    assert result.exit_code == 2 and "is neither a size like '40GiB' nor a GPU preset" in result.stderr


@pytest.mark.slow  # tests/parallel/test_parallel_offload.py covers offload itself in every make test
def test_cpu_offload_moves_the_sharded_state_to_the_host_and_fits_more_per_rank(small_llama, tmp_path):
    out = tmp_path / "offload.json"
    args = ["--capacity", CAPACITY, "--gpus", "2", "--seq-len", "64", "--cpu-offload", "--json", str(out)]
    result = invoke("estimate", small_llama, *args)
    assert result.exit_code == 0, result.output
    assert "rank 0 of 2, FSDP2 full shard, CPU offload" in result.output and "Host memory per rank" in result.output
    document = json.loads(out.read_text())
    assert document["parallelism"]["cpu_offload"] is True
    assert all(document["breakdown"][part] == 0 for part in ("sharded_parameters", "gradients", "optimizer_state"))
    host = document["choices"][0]["estimate"]["host_breakdown"]
    assert document["host_peak_bytes"] == sum(host.values()) and host["optimizer_state"] > 0
    plain = invoke("estimate", small_llama, *args[:-3], "--json", str(tmp_path / "plain.json"))
    assert plain.exit_code == 0, plain.output
    kept = json.loads((tmp_path / "plain.json").read_text())
    assert "host_peak_bytes" not in kept and kept["breakdown"]["optimizer_state"] > 0
    assert document["largest_batch_size"] > kept["largest_batch_size"]  # 5 against 4: the state left the device


@pytest.mark.slow
def test_a_plan_with_cpu_offload_says_what_the_host_holds(small_llama, tmp_path):
    out = tmp_path / "plan.json"
    args = ["--gpu", CAPACITY, "--gpus", "2", "--seq-len", "64", "--activation-checkpointing", "none", "--cpu-offload"]
    result = invoke("plan", small_llama, *args, "--global-batch-tokens", "1K", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "Host memory per rank (CPU offload)" in result.output and "for a node of 2 ranks" in result.output
    assert "gradient shards held" not in result.output  # offloaded: the window's gradients wait on the host
    (per_rank,) = json.loads(out.read_text())["sharding"]["per_rank"]
    assert per_rank["breakdown"]["optimizer_state"] == 0 < per_rank["host_breakdown"]["optimizer_state"]


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["find", "gpt-tiny", "--gpus", "2", "--cpu-offload", "--device", "sim:64MiB"], "host and device are one"),
        (["plan", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--cpu-offload", "--verify"], "drop --verify"),
    ],
)
def test_cpu_offload_in_real_trials_is_one_line(command, message):
    result = invoke(*command)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1
