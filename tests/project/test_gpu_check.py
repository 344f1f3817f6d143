"""The GPU check (``benchmarks/gpu_check.py``, ``make gpu-check``) and its comparison (``benchmarks/gpu_compare.py``),
checked where CI runs, on no GPU: the check fails fast and clearly without one, builds its models and runs its whole
orchestration on the CPU (``--dry-run``, ``--smoke``); the comparison, on a fixture of synthetic figures
(``tests/data/gpu_check/fixture.json``, marked as such), makes the predictions the library makes."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import batchfit as bf

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.py"
COMPARE = ROOT / "benchmarks" / "gpu_compare.py"
FIXTURE = ROOT / "tests" / "data" / "gpu_check" / "fixture.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_compare  # noqa: E402

HAS_DRIVER = any(os.path.exists(sign) for sign in gpu_check.DRIVER_SIGNS)
NO_GPU_LINE = "no CUDA device: run this on a machine with an NVIDIA GPU (torch.cuda.is_available() is False"


def _env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTORCH_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


@pytest.mark.skipif(HAS_DRIVER, reason="a GPU driver is here: the check would run")
def test_without_a_gpu_the_check_exits_2_at_once_with_one_line():
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, env=_env(), timeout=60)
    seconds = time.perf_counter() - started
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(NO_GPU_LINE), done.stderr
    assert seconds < 5  # a Python start-up: nothing heavy is imported first (below)


@pytest.mark.skipif(HAS_DRIVER, reason="a GPU driver is here: the check would run")
def test_without_a_gpu_the_check_imports_nothing_heavy():
    code = (
        "import json, runpy, sys\n"
        f"sys.argv = [{str(CHECK)!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(CHECK)!r}, run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    heavy = {'torch', 'transformers', 'timm', 'torchvision', 'batchfit'}\n"
        "    print(json.dumps([stop.code, sorted(heavy & {name.split('.')[0] for name in sys.modules})]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert json.loads(done.stdout) == [2, []], done.stderr


def test_the_check_names_torch_when_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # missing_cuda sets it where unset: restored after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.missing_cuda(check_driver=False) == f"{NO_GPU_LINE})"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gpu_check.missing_cuda(check_driver=False) is None


@pytest.mark.parametrize(
    ("card", "total", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", 85_017_493_504, "h100-80gb"),
        ("NVIDIA H200", 150_109_880_320, "h200-141gb"),
        ("NVIDIA H100 NVL", 99_983_917_056, None),
        ("NVIDIA A100-SXM4-80GB", 85_089_976_320, "a100-80gb"),
        ("NVIDIA GeForce RTX 4090", 25_386_352_640, None),
    ],
)
def test_the_card_is_mapped_to_its_preset(card, total, preset):
    assert gpu_check.preset_for(card, total)[0] == preset
    if preset:
        bf.TraceDevice(preset)  # a preset batchfit knows


@pytest.mark.slow  # builds every outside model and runs a step of each: about 9 s (make reliability)
def test_the_dry_run_builds_every_model_on_the_cpu():
    done = subprocess.run(
        [sys.executable, str(CHECK), "--dry-run", "--no-step"], capture_output=True, text=True, env=_env(), timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if ":" in line}
    for spec in gpu_check.MODELS:
        line = lines[spec.key]
        assert "built" in line or f"skipped, {spec.needs} is not importable" in line, line


def test_the_loop_runs_on_the_cpu_and_records_an_out_of_memory_error_by_its_step(monkeypatch):
    spec = gpu_check.SMOKE_MODELS[1]  # the tiny LSTM
    held = gpu_check.run_loop(spec, 3, 4, "cpu")
    assert (held["outcome"], held["steps_run"], len(held["per_step"])) == ("held", 4, 4)

    forward, calls = gpu_check._forward, []

    def forward_then_oom(*args):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (synthetic, for the test)")
        return forward(*args)

    monkeypatch.setattr(gpu_check, "_forward", forward_then_oom)
    failed = gpu_check.run_loop(spec, 3, 20, "cpu")
    assert (failed["outcome"], failed["oom_step"], failed["failed_phase"], failed["steps_run"]) == (
        "OOM at step 3",
        3,
        "forward",
        2,
    )


def test_a_snapshot_is_recorded_without_stacks_and_stored_gzipped(tmp_path):
    calls = []

    def dump(path):
        Path(path).write_bytes(pickle.dumps({"segments": [], "device_traces": [[]]}))

    memory = SimpleNamespace(_record_memory_history=lambda **kw: calls.append(kw), _dump_snapshot=dump)
    fake = SimpleNamespace(cuda=SimpleNamespace(memory=memory))
    gpu_check._start_history(fake)
    written = gpu_check._dump_history(fake, tmp_path / "gpt2-default-8")
    assert calls[0]["context"] is None and calls[0]["max_entries"] == gpu_check.SNAPSHOT_ENTRIES
    assert calls[-1] == {"enabled": None}
    assert written["file"] == "gpt2-default-8.pickle.gz"
    assert pickle.loads(gzip.decompress((tmp_path / written["file"]).read_bytes()))["segments"] == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpt2-default-8.pickle.gz"]


def test_the_bundle_stays_within_what_a_lent_machine_sends_back(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "SNAPSHOT_TAR_BYTES", 3000)
    work, folder = tmp_path / "work", tmp_path / "out"
    (work / "snapshots").mkdir(parents=True)
    (work / "logs").mkdir()
    (work / "logs" / "gpt2-search.log").write_text("x" * 10)
    folder.mkdir()
    for number in range(12):
        (work / "snapshots" / f"m{number:02}-default-8.pickle.gz").write_bytes(os.urandom(1200))
    run = gpu_check.Run(SimpleNamespace(), folder, work, time.time(), time.time() + 60, {"models": []})
    run.save()
    files = sorted(path.name for path in folder.iterdir())
    assert len(files) <= 8 and all(path.is_file() for path in folder.iterdir())
    assert files == ["gpu-check.json", "logs.tar.gz", *(f"snapshots-{n}.tar" for n in range(1, 5))]
    placed = json.loads((folder / "gpu-check.json").read_text())["snapshots"]
    assert sum(where.startswith("snapshots-") for where in placed.values()) == 8  # two a tar, four tars
    assert sum(where.startswith("left out") for where in placed.values()) == 4
    with tarfile.open(folder / "snapshots-1.tar") as tar:
        assert tar.getnames() == ["snapshots/m00-default-8.pickle.gz", "snapshots/m01-default-8.pickle.gz"]


@pytest.mark.slow  # the whole run on the CPU with tiny models: about 15 s (make reliability)
def test_the_smoke_run_writes_the_figures_and_the_comparison_reads_them(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(CHECK), "--smoke", "--models", "lstm", "--out", str(out), "--budget", "150"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in out.iterdir()) == ["gpu-check.json", "logs.tar.gz"]
    figures = json.loads((out / "gpu-check.json").read_text())
    assert figures["smoke"] and figures["complete"] and figures["preset"] == "h100-80gb"
    (lstm,) = figures["models"]
    assert lstm["status"] == "done" and lstm["fixed"]["outcome"] == "held"
    answer = lstm["search"]["batch_size"]
    assert answer == 8 and lstm["search"]["capped"]  # the smoke cap
    assert [(loop["allocator"], loop["batch"], loop["outcome"]) for loop in lstm["loops"]] == [
        ("default", 8, "held"),
        ("default", 9, "held"),
        ("expandable", 8, "held"),
        ("expandable", 9, "held"),
    ]
    assert figures["estimates"]["lstm"]["at_fixed_batch"]["batch"] == 4
    assert gpu_compare.main([str(out), "--models", "lstm"]) == 0
    assert "CPU smoke run: no GPU figures" in (out / "comparison.md").read_text()


def _fixture_gpt2() -> tuple[dict, gpu_check.ModelSpec]:
    figures = json.loads(FIXTURE.read_text())
    entry = next(model for model in figures["models"] if model["key"] == "gpt2")
    return entry, gpu_check.ModelSpec.from_dict(entry["spec"])


def test_the_fixture_says_its_figures_are_synthetic():
    figures = json.loads(FIXTURE.read_text())
    assert figures["fixture"] is True
    assert figures["note"] == "synthetic values for the comparison's test, not measured"
    assert "TEST FIXTURE" in figures["machine"]["card"]


@pytest.mark.slow  # traces each fixture model for the preset: about 13 s (make reliability)
def test_the_comparison_of_the_fixture_makes_the_librarys_predictions(tmp_path):
    pytest.importorskip("transformers", reason="the fixture's GPT-2 is Hugging Face's")
    report, predictions = tmp_path / "comparison.md", tmp_path / "comparison.json"
    assert gpu_compare.main([str(FIXTURE), "--out", str(report), "--json", str(predictions)]) == 0
    text = report.read_text()
    assert "TEST FIXTURE" in text.splitlines()[2]
    for columns in (gpu_compare.PEAK_COLUMNS, gpu_compare.ANSWER_COLUMNS, gpu_compare.LOOP_COLUMNS):
        assert f"| {' | '.join(columns)} |" in text
    assert "- vit: skipped: timm is not importable here (synthetic)" in text
    results = {model["key"]: model for model in json.loads(predictions.read_text())["models"]}

    # What the library gives for the same model, called here as a user calls it
    entry, spec = _fixture_gpt2()
    model, sample, loss_fn, make_optimizer = gpu_check.build(spec)

    def options():
        return {"loss_fn": loss_fn, "optimizer": make_optimizer(model), "amp_dtype": "bf16"}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = bf.estimate_memory(model, sample, entry["fixed"]["batch"], device="h100-80gb", **options())
        answer = bf.find_max_batch_size(
            model, sample, device=bf.TraceDevice("h100-80gb"), max_batch_size=spec.cap, **options()
        ).batch_size
        loops = {
            rows: bf.probe_batch_size(model, sample, rows, device=bf.TraceDevice("h100-80gb"), **options())
            for rows in (8, 9)
        }

    gpt2 = results["gpt2"]
    fixed = next(peak for peak in gpt2["peaks"] if peak["run"] == "the loop, 2 steps")
    assert (fixed["predicted_allocated"], fixed["predicted_reserved"]) == (
        estimate.peak_bytes,
        estimate.reserved_peak_bytes,
    )
    real = entry["fixed"]["peak_allocated_bytes"]
    assert fixed["error_allocated"] == pytest.approx((estimate.peak_bytes - real) / real)
    row = (
        f"| gpt2 | 4 | the loop, 2 steps | {real:,} | {estimate.peak_bytes:,} | "
        f"{(estimate.peak_bytes - real) / real:+.2%} |"
    )
    assert row in text
    default = next(answered for answered in gpt2["answers"] if answered["allocator"] == "default")
    assert (default["real"], default["predicted"]) == (8, answer)
    for loop in gpt2["loops"]:
        if loop["allocator"] != "default":
            continue
        trial = loops[loop["batch"]]
        assert (loop["predicted_fits"], loop["predicted_loop_steps"]) == (trial.fits, trial.loop_steps)
        assert loop["predicted"] == gpu_compare.predicted_outcome(trial)
    by_batch = {loop["batch"]: loop for loop in gpt2["loops"] if loop["allocator"] == "default"}
    assert by_batch[9]["real"] == "OOM at step 3" and loops[9].fits  # the fixture's outcome, synthetic
    assert (by_batch[8]["match"], by_batch[9]["match"]) == ("yes", "no")
    assert results["lstm"]["peaks"][0]["run"] == "the loop, 2 steps" and not results["lstm"]["loops"]
    assert results["vit"]["skipped"]


@pytest.mark.parametrize(
    ("real", "trial", "match"),
    [
        ({"outcome": "held", "steps_run": 20}, {"fits": True}, "yes"),
        ({"outcome": "held", "steps_run": 20}, {"fits": False, "oom": True, "loop_steps": 5}, "no"),
        (
            {"outcome": "held", "steps_run": 20},
            {"fits": False, "oom": True, "loop_steps": 40},
            "n/a (the model's OOM at step 40 comes after the 20 steps run)",
        ),
        ({"outcome": "OOM at step 3", "oom_step": 3}, {"fits": False, "oom": True, "loop_steps": 3}, "yes"),
        (
            {"outcome": "OOM at step 3", "oom_step": 3},
            {"fits": False, "oom": True, "loop_steps": 7},
            "yes (step 7, not 3)",
        ),
        ({"outcome": "OOM at step 3", "oom_step": 3}, {"fits": True}, "no"),
        ({"outcome": "held 12 of 20 steps (cut by time)", "steps_run": 12}, {"fits": True}, "yes (12 steps ran)"),
        ({"outcome": "error at step 1: RuntimeError"}, {"fits": True}, "n/a (error at step 1: RuntimeError)"),
    ],
)
def test_the_loops_outcome_is_matched_against_the_prediction(real, trial, match):
    fields = {"fits": False, "oom": False, "loop_steps": None, "steps": 2, "settled": None, "failed_phase": None}
    assert gpu_compare.loop_match(real, SimpleNamespace(**{**fields, **trial}), 20) == match
