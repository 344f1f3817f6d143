"""batchfit sweep, batchfit cache list|clear, and batchfit find --cache."""

from __future__ import annotations

import json
import os

import pytest

from batchfit.cli.sweep_run import parse_grid
from cli_runner import invoke
from cli_runner import refused

SWEEP = ["sweep", "gpt-tiny", "--grid", "seq_len=16,32", "--device", "sim:12MiB"]  # edges of 8 to 34 samples


def test_parse_grid_reads_numbers_bools_and_words():
    grid = parse_grid(["seq_len=128,256", "dropout=0.1", "flash=true,false", "kind=moe", "top-k=1"])
    assert grid == {"seq_len": [128, 256], "dropout": [0.1], "flash": [True, False], "kind": ["moe"], "top_k": [1]}


def test_sweep_prints_a_line_per_trial_a_table_and_writes_the_results_file(tmp_path):
    out = tmp_path / "sweep.json"
    result = invoke(*SWEEP, "--grid", "layers=1,2", "--json", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    sizes = {(r["seq_len"], r["layers"]): r["batch_size_used"] for r in document["summary"]}
    assert len(sizes) == 4 and sizes[(16, 1)] > sizes[(16, 2)] > sizes[(32, 2)]
    assert "Finding optimal batch size for seq_len=16, layers=1 (estimated: " in result.output
    assert f"Using batch size: {sizes[(32, 2)]} for seq_len=32, layers=2" in result.output
    assert "4 configurations, 8 trials (0 from the result cache)" in result.output
    again = invoke(*SWEEP, "--grid", "layers=1,2", "--json", str(tmp_path / "again.json"))
    assert again.exit_code == 0 and "4 configurations, 0 trials (4 from the result cache)" in again.output
    fresh = invoke(*SWEEP, "--grid", "layers=1", "--no-cache")  # two configurations the cache holds
    assert "2 configurations, 4 trials (0 from the result cache)" in fresh.output


def test_sweep_resumes_from_its_results_file(tmp_path):
    out = tmp_path / "sweep.json"
    assert invoke(*SWEEP, "--json", str(out), "--no-cache").exit_code == 0
    result = invoke(
        "sweep", "gpt-tiny", "--grid", "seq_len=16,32,48", "--device", "sim:12MiB", "--json", str(out), "--no-cache"
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("Already measured") == 2 and "3 configurations, 6 trials" in result.output
    assert [r["seq_len"] for r in json.loads(out.read_text())["summary"]] == [16, 32, 48]


def test_a_fixed_batch_size_is_checked_once(tmp_path):
    result = invoke(*SWEEP, "--no-auto-adjust", "--batch-size", "12", "--no-cache")
    assert result.exit_code == 0, result.output
    assert "Checking the fixed batch size 12 for seq_len=16" in result.output
    assert "2 configurations, 2 trials" in result.output and "Nothing fitted for: seq_len=32." in result.output


def test_generate_mode_and_rules_reach_the_sweep(tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps({"base_batch_size": 100, "knobs": {"seq_len": [{"upto": 16, "scale": 0.5}, {"scale": 0.25}]}})
    )
    result = invoke(
        *SWEEP,
        "--mode",
        "generate",
        "--max-new-tokens",
        "8",
        "--estimate",
        "rules",
        "--rules",
        str(rules),
        "--batch-size",
        "100",
        "--no-cache",
    )
    assert result.exit_code == 0, result.output
    assert "(estimated: 50, starting with: 50)" in result.output
    assert "(estimated: 25, starting with: 25)" in result.output


def test_measure_callback_from_a_file(tmp_path):
    (tmp_path / "measure.py").write_text("def accuracy(knobs, batch_size, workload):\n    return {'accuracy': 0.9}\n")
    out = tmp_path / "r.json"
    result = invoke(*SWEEP, "--measure", f"{tmp_path / 'measure.py'}:accuracy", "--json", str(out), "--no-cache")
    assert result.exit_code == 0, result.output
    assert [r["accuracy"] for r in json.loads(out.read_text())["summary"]] == [0.9, 0.9]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "seq_len"], "is not NAME=V1,V2"),
        (["--grid", "seq_len=1", "--grid", "seq_len=2"], "names seq_len twice"),
        (["--grid", "seq_len=16", "--seq-len", "8"], "both a fixed option and a --grid knob"),
        (["--grid", "width=16"], "does not take --width"),
        (["--grid", "seq_len=16", "--estimate", "guess"], "unknown estimate source"),
        (["--grid", "seq_len=16", "--no-auto-adjust"], "give it as max_batch_size (--batch-size)"),
        (["--grid", "seq_len=16", "--rules", "missing.json"], "rules file missing.json does not exist"),
        (["--grid", "seq_len=16", "--measure", "nothing"], "must be module:function"),
    ],
)
def test_sweep_errors_are_one_line_with_exit_code_2(args, message):
    result = invoke("sweep", "gpt-tiny", "--device", "sim:32MiB", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_find_with_cache_answers_the_second_time_with_zero_trials(tmp_path):
    args = ["find", "mlp", "--device", "sim:16MiB", "--cache", "--cache-dir", str(tmp_path)]
    first = invoke(*args, "--json", str(tmp_path / "first.json"))
    second = invoke(*args, "--json", str(tmp_path / "second.json"), "--plot", str(tmp_path / "p.png"))
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("first", "second"))
    assert one["batch_size"] == two["batch_size"] and len(one["trials"]) >= 2 and two["trials"] == []
    assert two["cache"]["hit"] and two["cache"]["trials"] == len(one["trials"])
    assert "from the result cache: no trials run now" in second.output
    assert "No plot: the answer came from the cache" in second.stderr and not (tmp_path / "p.png").exists()
    assert invoke("find", "mlp", "--device", "sim:16MiB", "--quiet").output.strip() == str(one["batch_size"])


def test_cache_list_and_clear(tmp_path):
    invoke("find", "mlp", "--device", "sim:16MiB", "--cache", "--cache-dir", str(tmp_path))
    listed = invoke("cache", "list", "--cache-dir", str(tmp_path))
    assert listed.exit_code == 0 and ": 1 results" in listed.output and "mlp" in listed.output
    cleared = invoke("cache", "clear", "--cache-dir", str(tmp_path))
    assert cleared.exit_code == 0 and "Removed 1 results" in cleared.output
    assert ": 0 results" in invoke("cache", "list", "--cache-dir", str(tmp_path)).output


def test_a_garbage_cache_file_is_one_warning_line_not_a_crash(tmp_path):
    (tmp_path / "results.sqlite").write_bytes(os.urandom(4096))
    result = invoke("cache", "list", "--cache-dir", str(tmp_path))
    assert result.exit_code == 0 and ": 0 results" in result.output
    swept = invoke(*SWEEP, "--cache-dir", str(tmp_path))
    assert swept.exit_code == 0 and "2 configurations, 4 trials" in swept.output


def test_every_new_command_shows_an_example():
    for args in (["sweep"], ["cache"], ["cache", "list"], ["cache", "clear"]):
        result = invoke(*args, "--help")
        assert result.exit_code == 0 and "Example: batchfit" in result.output


def test_a_sweep_where_no_configuration_fits_prints_its_table_then_exits_2_in_one_line(tmp_path):
    out = tmp_path / "sweep.json"
    result = invoke("sweep", "gpt-tiny", "--grid", "seq_len=64,128", "--device", "sim:1MiB", "--json", str(out))
    assert result.exit_code == 2, result.output
    assert "Nothing fitted for" in result.output and out.exists()  # the table and the results file come first
    assert result.stderr.startswith("error: no configuration fitted on sim:1.0MiB") and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "mpi"], "unknown engine 'mpi': choose from inline, local, slurm, ray"),
        (["--engine", "local", "--workers", "2", "--partition", "gpu"], "--partition is for the slurm or ray engine"),
        (["--workers", "2", "--slots", "cuda:0"], "give --slots (devices) or --workers (a count), not both"),
        (["--engine", "local", "--slots", "cuda:0,cuda:0"], "must name each device once"),
        (["--engine", "local", "--workers", "0"], "--workers must be between 1 and 1024, got 0"),
        (["--engine", "local", "--workers", "2", "--grid", "nope=1"], "workload gpt-tiny does not take --nope"),
    ],
)
def test_sweep_engine_options_that_cannot_work_are_one_line(flags, message):
    refused(invoke(*SWEEP, *flags), message)
