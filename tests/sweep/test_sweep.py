"""Per-configuration sweeps: true edges, fewer trials than grow, estimates, the upper
limit, fixed sizes, the results file (resume after SIGKILL), the measure callback and the log."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import batchfit as bf
from batchfit.search.prober import Prober
from batchfit.sweep.api import grid_configs
from batchfit.sweep.api import sweep_grid
from models import decoder

# One worker builds the module's shared fixture once under pytest-xdist (--dist loadgroup), not once per worker.
pytestmark = pytest.mark.xdist_group("sweep")

# Small enough that every true edge is a short linear scan (17 samples at most), large enough that
# two layers fit. Two values per knob are all the default run needs: the fourth configuration is
# the first that the memory model fitted across the others can estimate.
CAPACITY = "640KiB"
GRID = {"seq_len": [8, 16], "layers": [1, 2]}
_EDGES: dict[tuple, int] = {}


def true_edge(seq_len: int, layers: int) -> int:
    """Probe 1, 2, 3, ... until the first failure."""
    if (seq_len, layers) not in _EDGES:
        device = bf.SimulatedDevice(CAPACITY)
        with Prober(decoder(seq_len, layers), device, limit_bytes=device.capacity_bytes()) as prober:
            size = 1
            while prober.probe(size).fits:
                size += 1
        _EDGES[(seq_len, layers)] = size - 1
    return _EDGES[(seq_len, layers)]


@pytest.fixture(scope="module")
def default_run():
    lines: list[str] = []
    result = sweep_grid(decoder, GRID, device=f"sim:{CAPACITY}", cache=False, log=lines.append)
    return result, lines


def test_every_configuration_gets_its_true_edge(default_run):
    result, _ = default_run
    assert [(r["seq_len"], r["layers"]) for r in result.records] == [
        (c["seq_len"], c["layers"]) for c in grid_configs(GRID)
    ]
    for record in result.records:
        edge = true_edge(record["seq_len"], record["layers"])
        assert record["batch_size_used"] == edge and record["exact"], record
        sizes = [t["batch_size"] for t in record["trials"]]
        assert edge in sizes and edge + 1 in sizes  # the answer and the size above it were both tried


def test_the_default_needs_fewer_trials_than_grow_per_configuration(default_run):
    result, _ = default_run
    grown = sweep_grid(decoder, GRID, device=f"sim:{CAPACITY}", strategy="grow", estimate=(), cache=False)
    assert result.total_trials < grown.total_trials
    assert result.total_trials == 2 * len(result.records)  # the estimate, then the size above it
    for record in grown.records:  # grow (5 trials at most) never overshoots, but may stop short
        assert record["batch_size_used"] <= true_edge(record["seq_len"], record["layers"])
        assert len(record["trials"]) <= 5


def test_estimates_come_from_the_trace_then_from_the_measured_configurations(default_run):
    result, _ = default_run
    sources = [r["estimate_source"] for r in result.records]
    assert sources[:2] == ["trace", "trace"]  # no model from fewer than two configurations
    assert "model" in sources[2:]
    for record in result.records:
        assert record["trials"][0]["batch_size"] == record["starting_with"] == record["estimated"]


def test_the_log_reads_like_a_hand_written_sweep_script(default_run):
    _, lines = default_run
    assert lines[0] == "Testing seq_len=8, layers=1"
    assert lines[1].startswith("Finding optimal batch size for seq_len=8, layers=1 (estimated: ")
    assert lines[1].endswith(f", starting with: {true_edge(8, 1)})...")
    assert lines[2].startswith(f"✓ Batch size {true_edge(8, 1)} works for seq_len=8, layers=1")
    assert lines[3] == f"  Trying larger batch size: {true_edge(8, 1) + 1}..."
    assert lines[4].startswith(f"✗ Batch size {true_edge(8, 1) + 1} caused OOM")
    assert lines[5] == f"Using batch size: {true_edge(8, 1)} for seq_len=8, layers=1"


def test_rules_give_the_start_and_the_upper_limit_is_never_exceeded():
    rules = {"base_batch_size": 12, "knobs": {"seq_len": [{"upto": 8, "scale": 1.0}, {"scale": 0.5}]}}
    assert true_edge(8, 1) > 12 >= true_edge(16, 1)  # the cap binds on the first configuration only
    result = sweep_grid(
        decoder,
        {"seq_len": [8, 16]},
        device=f"sim:{CAPACITY}",
        max_batch_size=12,
        estimate=("rules",),
        rules=rules,
        cache=False,
    )
    first, second = result.records
    assert (first["estimated"], first["estimate_source"], first["starting_with"]) == (12, "rules", 12)
    assert first["batch_size_used"] == 12 and max(t["batch_size"] for t in first["trials"]) == 12  # edge > cap 12
    assert [t["batch_size"] for t in first["trials"]] == [12]
    assert second["estimated"] == 6 and second["batch_size_used"] == true_edge(16, 1)


def test_grow_from_the_rules_estimate_grows_by_half_while_it_fits():
    rules = {"knobs": {"seq_len": [{"scale": 0.3}]}}
    result = sweep_grid(
        decoder,
        {"seq_len": [8]},
        device=f"sim:{CAPACITY}",
        max_batch_size=32,
        strategy="grow",
        estimate=("rules",),
        rules=rules,
        cache=False,
    )
    sizes = [t["batch_size"] for t in result.records[0]["trials"]]
    assert sizes[:3] == [9, 13, 19]  # 32 * 0.3 = 9, then x1.5 while it fits (19 is above the edge)
    assert 13 <= true_edge(8, 1) < 19
    assert len(sizes) == 5 and result.records[0]["batch_size_used"] <= true_edge(8, 1)


def test_a_fixed_size_is_checked_once_and_reported():
    result = sweep_grid(
        decoder, {"seq_len": [8, 24]}, device=f"sim:{CAPACITY}", max_batch_size=10, auto_adjust=False, cache=False
    )
    small, large = result.records
    assert [t["batch_size"] for t in small["trials"]] == [10] and small["fits"] and small["batch_size_used"] == 10
    assert [t["batch_size"] for t in large["trials"]] == [10] and not large["fits"] and large["batch_size_used"] == 10
    assert "does not fit" in large["error"]
    with pytest.raises(ValueError, match="give it as max_batch_size"):
        sweep_grid(decoder, {"seq_len": [8]}, auto_adjust=False)


def test_a_configuration_where_nothing_fits_is_recorded_and_the_sweep_goes_on():
    result = sweep_grid(decoder, {"seq_len": [8, 4000]}, device="sim:600KiB", cache=False)
    assert result.records[0]["batch_size_used"] > 0
    # the state fits (the sample is host data, never counted); one row of 4000 tokens does not
    assert (
        result.records[1]["batch_size_used"] is None and "even batch size 1 does not fit" in result.records[1]["error"]
    )


def test_measure_runs_with_the_batch_found_and_joins_the_record(tmp_path):
    seen = []

    def accuracy(knobs, batch_size, workload):
        seen.append((knobs["seq_len"], batch_size, workload.name))
        return {"accuracy": 0.5 + knobs["seq_len"] / 100}

    result = sweep_grid(
        decoder,
        {"seq_len": [8, 16]},
        device=f"sim:{CAPACITY}",
        measure=accuracy,
        cache=False,
        results_path=tmp_path / "r.json",
    )
    assert [r["accuracy"] for r in result.records] == [0.58, 0.66]
    assert seen == [(8, true_edge(8, 1), "decoder"), (16, true_edge(16, 1), "decoder")]
    saved = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert [r["accuracy"] for r in saved] == [0.58, 0.66]
    scalar = sweep_grid(decoder, {"seq_len": [8]}, device=f"sim:{CAPACITY}", measure=lambda k, b, w: b * 2, cache=False)
    assert scalar.records[0]["result"] == 2 * true_edge(8, 1)
    with pytest.raises(ValueError, match="which the record already has"):
        sweep_grid(
            decoder, {"seq_len": [8]}, device=f"sim:{CAPACITY}", measure=lambda k, b, w: {"seq_len": 1}, cache=False
        )


def test_the_results_file_has_a_summary_record_per_configuration(tmp_path):
    path = tmp_path / "results.json"
    sweep_grid(decoder, {"seq_len": [8, 16]}, device=f"sim:{CAPACITY}", results_path=path, cache=False)
    document = json.loads(path.read_text())
    assert {"summary", "device", "versions", "knobs", "settings"} <= set(document)
    assert document["device"]["name"] == "sim:640.0KiB" and document["knobs"] == ["seq_len"]
    record = document["summary"][0]
    assert record["seq_len"] == 8 and record["batch_size_used"] == true_edge(8, 1)
    assert {"trials", "peak_bytes", "seconds"} <= set(record) and record["trials"][0]["fits"]


def test_a_rerun_resumes_and_measures_only_what_is_missing(tmp_path):
    path = tmp_path / "results.json"
    sweep_grid(decoder, {"seq_len": [8, 16]}, device=f"sim:{CAPACITY}", results_path=path, cache=False)
    lines: list[str] = []
    result = sweep_grid(
        decoder, {"seq_len": [8, 16, 24]}, device=f"sim:{CAPACITY}", results_path=path, cache=False, log=lines.append
    )
    assert sum(line.startswith("Already measured") for line in lines) == 2
    assert sum(line.startswith("Testing") for line in lines) == 1
    assert [r["batch_size_used"] for r in result.records] == [true_edge(s, 1) for s in (8, 16, 24)]
    assert len(json.loads(path.read_text())["summary"]) == 3


def test_a_results_file_that_is_not_one_is_left_alone(tmp_path):
    path = tmp_path / "results.json"
    path.write_text("my notes, not JSON")
    with pytest.raises(ValueError, match="not a batchfit sweep results file.*move it away"):
        sweep_grid(decoder, {"seq_len": [8]}, device=f"sim:{CAPACITY}", results_path=path, cache=False)
    assert path.read_text() == "my notes, not JSON"
    sweep_grid(decoder, {"seq_len": [8]}, device=f"sim:{CAPACITY}", results_path=tmp_path / "ok.json", cache=False)
    with pytest.raises(ValueError, match="another device"):
        sweep_grid(decoder, {"seq_len": [8]}, device="sim:2MiB", results_path=tmp_path / "ok.json", cache=False)


def test_a_sweep_answers_from_the_cache_the_second_time(tmp_path):
    first = sweep_grid(decoder, {"seq_len": [8, 16]}, device=f"sim:{CAPACITY}", cache=tmp_path)
    second = sweep_grid(decoder, {"seq_len": [8, 16]}, device=f"sim:{CAPACITY}", cache=tmp_path)
    assert first.total_trials == 4 and second.total_trials == 0
    assert all(r["cached"] for r in second.records)
    assert [r["batch_size_used"] for r in second.records] == [r["batch_size_used"] for r in first.records]
    third = sweep_grid(decoder, {"seq_len": [8, 16]}, device=f"sim:{CAPACITY}", cache=tmp_path, max_batch_size=20)
    assert third.total_trials > 0  # another upper limit is another search


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ({}, "must map each knob"),
        ({"seq_len": []}, "non-empty list"),
        ({"seq_len": "8,16"}, "non-empty list"),
        ({"width": [8]}, "does not take --width"),
    ],
)
def test_bad_grids_are_clear_errors(grid, message):
    with pytest.raises(ValueError, match=message):
        sweep_grid(decoder, grid, device=f"sim:{CAPACITY}", cache=False)


def test_unknown_estimate_sources_and_strategies_are_clear_errors():
    with pytest.raises(ValueError, match="unknown estimate source"):
        sweep_grid(decoder, {"seq_len": [8]}, estimate=("guess",))
    with pytest.raises(ValueError, match="unknown strategy"):
        sweep_grid(decoder, {"seq_len": [8]}, strategy="fastest")


KILLABLE = """
import sys, time
sys.path.insert(0, {support!r})
from models import decoder
from batchfit.sweep.api import sweep_grid

def slow(knobs, batch_size, workload):
    time.sleep(float(sys.argv[2]))
    return {{"accuracy": batch_size / 100}}

# estimate=("model",): no trace (it is not what this test is about), and the resumed run's later
# configurations start from the memory model fitted across the records it resumed.
sweep_grid(decoder, {{"seq_len": [8, 12, 16, 20]}}, device="sim:{capacity}", results_path=sys.argv[1], measure=slow,
      cache=False, estimate=("model",))
"""


def _records(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["summary"]
    except (FileNotFoundError, ValueError):
        return []


@pytest.mark.slow  # a campaign: make reliability runs it
def test_a_sweep_killed_midway_resumes_to_identical_results(tmp_path, monkeypatch):
    script = tmp_path / "run.py"
    script.write_text(KILLABLE.format(support=str(Path(__file__).parents[1] / "support"), capacity=CAPACITY))
    reference, killed = tmp_path / "reference.json", tmp_path / "killed.json"
    monkeypatch.setattr(sys, "argv", [str(script), str(reference), "0"])
    monkeypatch.setattr(sys, "path", [*sys.path])  # the script prepends tests/support
    runpy.run_path(str(script), run_name="__main__")  # the uninterrupted run: here, sparing a process start
    proc = subprocess.Popen([sys.executable, str(script), str(killed), "0.5"])
    deadline = time.monotonic() + 120
    while len(_records(killed)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = _records(killed)
    assert 2 <= len(partial) < 4, "the kill should land mid-sweep"
    subprocess.run([sys.executable, str(script), str(killed), "0"], check=True, timeout=300)

    def essence(records: list[dict]) -> list[tuple]:
        return [
            (
                r["seq_len"],
                r["batch_size_used"],
                r["peak_bytes"],
                r["accuracy"],
                [(t["batch_size"], t["fits"], t["peak_bytes"]) for t in r["trials"]],
            )
            for r in records
        ]

    final = _records(killed)
    assert essence(final) == essence(_records(reference))
    assert len({r["seq_len"] for r in final}) == len(final) == 4  # no duplicate records
    assert essence(final[: len(partial)]) == essence(partial)  # what was written before the kill was kept


def test_one_device_object_for_the_whole_sweep_does_not_carry_earlier_models():
    """Like a real GPU, a shared simulated device counts whatever is alive on it: a sweep must free each
    configuration's model before the next one's search."""
    shared = bf.SimulatedDevice(CAPACITY)
    result = sweep_grid(decoder, {"seq_len": [8, 16, 24]}, device=shared, cache=False)
    assert [r["batch_size_used"] for r in result.records] == [true_edge(s, 1) for s in (8, 16, 24)]
