"""batchfit critical: the noise scale, the tradeoff table, the recommended global batch, --empirical, JSON."""

from __future__ import annotations

import json

import pytest

import batchfit as bf
from batchfit.cli.critical_run import draws
from batchfit.cli.workloads import load_workload
from cli_runner import invoke


def test_critical_prints_the_noise_scale_the_table_and_the_plan(tmp_path):
    out = tmp_path / "noise.json"
    result = invoke(
        "critical", "mlp", "--steps", "20", "--per-device-batch-size", "16", "--devices", "2", "--json", str(out)
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    noise = document["noise_scale"]
    work = load_workload("mlp", sample_size=512)
    expected = bf.measure_noise_scale(
        work.model, draws(work.sample_batch, 64, 0), loss_fn=work.loss_fn, steps=20, micro_batch_size=8
    )
    assert noise["b_simple"] == pytest.approx(expected.b_simple) and noise["steps"] == 20
    configuration = document["plan"]["batch_configuration"]
    assert configuration["per_gpu_batch_size"] <= 16 and configuration["devices"] == 2
    assert configuration["total_batch_size"] % 2 == 0
    assert f"Gradient noise scale B_simple = {expected.b_simple:,.1f}" in result.output
    assert "steps / fewest" in result.output and "Recommended global batch:" in result.output


def test_empirical_adds_equal_sample_training_runs_per_batch_size(tmp_path):
    out = tmp_path / "noise.json"
    result = invoke(
        "critical",
        "mlp",
        "--steps",
        "5",
        "--empirical",
        "--batch-sizes",
        "8,16,32",
        "--samples",
        "256",
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    empirical = json.loads(out.read_text())["empirical"]
    assert [p["batch_size"] for p in empirical["points"]] == [8, 16, 32]
    assert [p["steps"] for p in empirical["points"]] == [32, 16, 8]
    assert "Validation loss after equal samples" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "8", "--micro-batch-size", "8"], "must be larger than --micro-batch-size"),
        (["--steps", "1"], "steps must be an integer of at least 2"),
    ],
)
def test_critical_errors_are_one_line_with_exit_code_2(args, message):
    result = invoke("critical", "mlp", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_the_help_says_the_empirical_check_is_expensive():
    result = invoke("critical", "--help")
    assert (
        result.exit_code == 0
        and "Expensive by nature" in result.output
        and "Example: batchfit critical" in result.output
    )


def test_optimal_with_a_noise_scale_reports_the_goodput_optimum(tmp_path):
    from batchfit.planning.noise import goodput_optimal_batch

    out = tmp_path / "optimal.json"
    result = invoke("optimal", "mlp", "--device", "sim:12MiB", "--noise-scale", "400", "--json", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    found = document["goodput"]
    line = goodput_optimal_batch(
        document["alpha_seconds"], document["beta_seconds_per_sample"], 400.0, document["largest_batch_size"]
    )
    assert found["optimal_batch_size"] == line
    best = max(found["points"], key=lambda p: p["goodput"])
    assert found["best_measured_batch_size"] == best["batch_size"]
    assert all(p["goodput"] == pytest.approx(p["samples_per_second"] * p["efficiency"]) for p in found["points"])
    assert "Goodput (throughput x statistical efficiency, Pollux)" in result.output
