"""The batchfit command: every option, every error, Ctrl-C, JSON against the schema, the PNG."""

from __future__ import annotations

import json
import struct
import sys
import textwrap
from importlib import resources
from pathlib import Path

import jsonschema
import pytest

from batchfit.cli.app import app
from batchfit.search.strategies import Binary
from batchfit.search.strategies import SearchSpace
from cli_runner import invoke
from cli_runner import runner
from strategy_harness import run_strategy

TINY = """
import torch
import batchfit as bf

def make(width: int = 16, fail_after: int = 0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    calls = []

    def loss_fn(output, targets):
        calls.append(1)
        if fail_after and len(calls) > fail_after:
            raise KeyboardInterrupt
        return torch.nn.functional.cross_entropy(output, targets)

    batch = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
    return bf.Workload(model, batch, loss_fn, torch.optim.Adam(model.parameters()))

def not_a_workload():
    return {"model": None}
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny_workload.py"
    path.write_text(textwrap.dedent(TINY))
    return f"{path}:make"


def schema() -> dict:
    return json.loads(resources.files("batchfit").joinpath("search/schemas/search_result.schema.json").read_text())


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_help_shows_an_example_for_every_command():
    for args in ([], ["find"], ["estimate"], ["optimal"], ["plan"], ["tokens"], ["list-workloads"]):
        result = invoke(*args, "--help")
        assert result.exit_code == 0
        assert "Example: batchfit" in result.output


def test_list_workloads_names_the_built_ins():
    result = invoke("list-workloads")
    assert result.exit_code == 0
    lines = result.output.strip().splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["gpt-tiny", "lm-tiny", "cnn-small", "mlp"]
    assert lines[4].startswith("LLMs built from their published configs")
    assert [line.split()[0] for line in lines[5:]] == [
        "llama-3-8b",
        "llama-3-70b",
        "mistral-7b",
        "qwen2.5-7b",
        "gpt2-xl",
    ]
    assert "llama: 32 layers, width 4096, vocabulary 128256" in lines[5]


def test_find_on_a_user_file_prints_live_lines_a_table_and_the_answer(tiny, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = ("--device", "sim:300KiB", "--trace", "--json", str(out_json), "--plot", str(out_png))
    result = invoke("find", tiny, *args)
    assert result.exit_code == 0, result.output
    document = json.loads(out_json.read_text())
    jsonschema.validate(document, schema())
    size = document["batch_size"]
    assert "Simulated: a 300.0 KiB device on the CPU" in result.output
    assert f"✓ Batch size {size} fits — peak " in result.output and " of 300.0 KiB (" in result.output
    assert f"✗ Batch size {size + 1}: out of memory in " in result.output
    assert f"found by 'auto' in 2 trials after a trace estimate of {size}" in result.output
    assert "; traced: trace=True" in result.output  # why auto traced first (the line may wrap after it)
    assert "Trials" in result.output
    assert f"Largest batch size that fits on sim:300.0KiB: {size} " in result.output
    assert document["device"] == {"name": "sim:300.0KiB", "simulated": True, "capacity_bytes": 300 * 1024}
    assert document["workload"]["name"].endswith("tiny_workload.py:make")
    assert set(document["versions"]) == {"batchfit", "torch", "python", "platform"}
    assert png_size(out_png) == (1000, 600)


def test_quiet_prints_only_the_batch_size(tiny):
    result = invoke("find", tiny, "--device", "sim:300KiB", "--quiet")
    assert result.exit_code == 0
    assert result.stdout.strip().isdigit()


def test_strategy_and_bounds_reach_the_search(tiny, tmp_path):
    out = tmp_path / "r.json"
    result = invoke(
        "find", tiny, "--device", "sim:300KiB", "--strategy", "binary", "--max-batch-size", "64", "--json", str(out)
    )
    assert result.exit_code == 0
    document = json.loads(out.read_text())
    expected, _ = run_strategy(Binary(), SearchSpace(1, 64), lambda b: b <= document["batch_size"])
    assert [t["batch_size"] for t in document["trials"]] == expected
    assert document["strategy"] == "binary" and document["max_batch_size"] == 64


def test_min_batch_size_margin_and_max_trials_reach_the_search(tiny, tmp_path):
    out = tmp_path / "r.json"
    plain = json.loads(_run_json(tiny, out)["text"])
    margin = json.loads(_run_json(tiny, out, "--margin", "0.05")["text"])
    assert margin["limit_bytes"] == 300 * 1024 - int(0.05 * 300 * 1024)
    assert margin["batch_size"] < plain["batch_size"]
    assert json.loads(_run_json(tiny, out, "--margin", "8KiB")["text"])["limit_bytes"] == 292 * 1024
    limited = json.loads(_run_json(tiny, out, "--strategy", "power", "--max-trials", "2")["text"])
    assert [t["batch_size"] for t in limited["trials"]] == [1, 2] and not limited["exact"]
    from_five = json.loads(_run_json(tiny, out, "--min-batch-size", "5", "--no-trace")["text"])
    assert from_five["trials"][0]["batch_size"] == 5 and from_five["min_batch_size"] == 5
    assert "trace" not in from_five


def _run_json(tiny, out, *args):
    result = invoke("find", tiny, "--device", "sim:300KiB", "--json", str(out), *args)
    assert result.exit_code == 0, result.output
    return {"text": out.read_text()}


def test_workload_options_reach_the_built_ins(tmp_path):
    out = tmp_path / "r.json"
    args = ["--device", "sim:12MiB", "--max-trials", "1", "--json", str(out)]  # small batches: fp16 is slow on a CPU
    assert invoke("find", "gpt-tiny", "--seq-len", "16", "--amp", "bf16", *args).exit_code == 0
    document = json.loads(out.read_text())
    assert document["workload"] == {
        "name": "gpt-tiny",
        "options": {"seq_len": 16, "amp_dtype": "bf16", "keep_output": True},
    }
    assert invoke("find", "cnn-small", "--image-size", "16", "--drop-output", *args).exit_code == 0
    assert json.loads(out.read_text())["workload"]["options"] == {"image_size": 16, "keep_output": False}
    assert invoke("find", "mlp", "--amp", "fp16", *args).exit_code == 0


def test_auto_device_says_plainly_that_it_simulates():
    result = invoke("find", "mlp", "--max-trials", "1", "--no-trace")  # one trial of batch size 1
    assert result.exit_code == 0
    assert "Simulated: a 256.0 MiB device on the CPU, not a GPU measurement" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_such_module_here:make"], "no module named 'no_such_module_here'"),
        (["missing_file.py:make"], "workload file missing_file.py does not exist"),
        (["resnet9000"], "unknown workload 'resnet9000': use one of gpt-tiny, lm-tiny, cnn-small, mlp"),
        (["mlp", "--device", "tpu"], "unknown device 'tpu'"),
        (["mlp", "--device", "sim:lots"], "capacity 'lots' is not a size"),
        (["mlp", "--min-batch-size", "0"], "min_batch_size must be an integer of at least 1, got 0"),
        (
            ["mlp", "--seq-len", "64"],
            "workload mlp does not take --seq-len (it takes --features, --amp-dtype, --sample-size)",
        ),
        (["mlp", "--device", "sim:7.1MiB"], "even batch size 1 does not fit on sim:7.1MiB"),
        (["mlp", "--device", "sim:1MiB"], "before any batch"),
        (["mlp", "--strategy", "fastest"], "unknown strategy 'fastest'"),
        (["mlp", "--max-seconds", "0"], "max_seconds must be above 0"),
        (["mlp", "--device", "sim:8MiB", "--max-seconds", "1e-9"], "max_seconds ran out before any size fitted"),
        (
            ["mlp", "--json", "no/such/folder/r.json", "--max-trials", "1", "--no-trace"],
            "folder no/such/folder does not exist",
        ),
    ],
)
def test_errors_are_one_line_on_stderr_with_exit_code_2(args, message):
    result = invoke("find", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_a_module_in_the_current_folder_loads_as_python_m_would(tiny, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "mywork.py").write_text(Path(tiny.split(":")[0]).read_text())
    monkeypatch.chdir(folder)
    before = list(sys.path)
    result = invoke("find", "mywork:make", "--device", "sim:300KiB", "--quiet")
    assert result.exit_code == 0, result.output
    assert int(result.output.split()[-1]) > 0 and sys.path == before  # the folder was on sys.path only to import


def test_a_function_returning_the_wrong_type(tiny):
    result = invoke("find", tiny.replace(":make", ":not_a_workload"))
    assert result.exit_code == 2
    assert "returned dict, not a batchfit.Workload" in result.stderr


def test_debug_shows_the_traceback():
    result = invoke("find", "resnet9000", "--debug")
    assert result.exit_code != 0
    assert isinstance(result.exception, ValueError)


def test_missing_matplotlib_is_a_clear_error_before_the_search(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    result = invoke("find", "mlp", "--plot", str(tmp_path / "r.png"))
    assert result.exit_code == 2
    assert "plots need matplotlib: pip install 'batchfit[plot]'" in result.stderr
    assert "Batch size" not in result.output


def _interrupted_after(tiny: str, calls: int) -> str:
    path = tiny.rpartition(":")[0]
    with open(path, "a") as handle:
        handle.write(f"\n\ndef make_interrupted():\n    return make(fail_after={calls})\n")
    return f"{path}:make_interrupted"


def test_ctrl_c_stops_cleanly_with_the_trials_so_far(tiny, tmp_path):
    # the loss raises KeyboardInterrupt in its 5th call: two trials of two steps, then the third
    out = tmp_path / "i.json"
    result = invoke(
        "find", _interrupted_after(tiny, 4), "--device", "sim:300KiB", "--strategy", "power", "--json", str(out)
    )
    assert result.exit_code == 130
    assert (
        "✓ Batch size 1 fits" in result.output and "✓ Batch size 2 fits" in result.output and "Trials" in result.output
    )
    assert (
        "Interrupted: the model and optimizer are restored; the largest size that fitted so far was 2" in result.stderr
    )
    assert not out.exists()  # nothing half-written


def test_ctrl_c_during_the_trace_stops_cleanly_too(tiny, tmp_path):
    result = invoke("find", _interrupted_after(tiny, 1), "--device", "sim:300KiB")
    assert result.exit_code == 130
    assert "Interrupted: the model and optimizer are restored." in result.stderr
    assert "Batch size" not in result.output


def test_estimate_on_a_gpu_preset_prints_the_answer_and_the_breakdown(tmp_path):
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    result = invoke(
        "estimate", "mlp", "--gpu", "a100-40gb", "--batch-size", "64", "--json", str(out_json), "--plot", str(out_png)
    )
    assert result.exit_code == 0, result.output
    assert "on NVIDIA A100 40GB (38.8 GiB usable), traced on fake tensors: nothing runs on a GPU." in result.output
    for row in ("parameters", "gradients", "optimizer state", "activations", "batch", "temporaries", "total (peak)"):
        assert row in result.output
    assert "Batch size 64 fits: peak " in result.output
    document = json.loads(out_json.read_text())
    estimate = document["estimate"]
    assert sum(estimate["breakdown"].values()) == estimate["peak_bytes"] and estimate["fits"] is True
    assert f"Largest batch size that fits: {document['largest_batch_size']} " in result.output
    assert document["device"]["gpu"] == "a100-40gb" and document["search"]["exact"]
    assert png_size(out_png) == (1000, 600)


def test_estimate_says_when_a_batch_does_not_fit():
    result = invoke("estimate", "gpt-tiny", "--capacity", "64MiB", "--batch-size", "4096")
    assert result.exit_code == 0, result.output
    assert "Batch size 4096 does not fit: peak " in result.output and "of 64.0 MiB" in result.output


def test_estimate_quiet_prints_the_largest_batch_only():
    result = invoke("estimate", "cnn-small", "--capacity", "64MiB", "--quiet")
    assert result.exit_code == 0 and result.stdout.strip().isdigit()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["mlp"], "give exactly one of --gpu"),
        (["mlp", "--gpu", "a100-40gb", "--capacity", "40GiB"], "give exactly one of --gpu"),
        (["mlp", "--gpu", "a200"], "unknown GPU 'a200'"),
        (["mlp", "--gpu", "a100-40gb", "--reserve", "lots"], "reserve 'lots' is not a size"),
        (["mlp", "--capacity", "1MiB"], "before any batch"),
    ],
)
def test_estimate_errors_are_one_line_with_exit_code_2(args, message):
    result = invoke("estimate", *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_plan_splits_32k_tokens_into_16_x_8_scales_the_lr_linearly_and_writes_the_batch_configuration(tmp_path):
    out = tmp_path / "plan.json"
    result = invoke(
        "plan",
        "--micro-batch-size",
        "16",
        "--global-batch-tokens",
        "32768",
        "--seq-len",
        "256",
        "--devices",
        "1",
        "--base-lr",
        "3e-4",
        "--base-batch-size",
        "8192",
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert (
        "16 per device x 8 accumulation steps x 1 device(s) = 128 samples = 32,768 tokens per optimizer step."
        in result.output
    )
    configuration = json.loads(out.read_text())["batch_configuration"]
    assert configuration["gradient_accumulation_steps"] == 8 and configuration["learning_rate"] == pytest.approx(1.2e-3)


def test_plan_measures_the_micro_batch_on_a_workload(tiny):
    result = invoke("plan", tiny, "--device", "sim:300KiB", "--global-batch-size", "4096")
    assert result.exit_code == 0, result.output
    assert (
        "Measured on sim:300.0KiB: the largest micro-batch is " in result.output and "= 4096 samples" in result.output
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--global-batch-size", "64"], "give --micro-batch-size N, or a WORKLOAD"),
        (["--micro-batch-size", "16", "--global-batch-tokens", "4096"], "global_batch_tokens needs seq_len"),
        (
            ["--micro-batch-size", "16", "--global-batch-size", "64", "--devices", "0"],
            "devices must be a positive integer",
        ),
        (
            ["--micro-batch-size", "16", "--global-batch-size", "64", "--base-lr", "-1", "--base-batch-size", "8"],
            "base_lr must be a positive, finite number",
        ),
    ],
)
def test_plan_errors_are_one_line_with_exit_code_2(args, message):
    result = invoke("plan", *args)
    assert result.exit_code == 2 and message in result.stderr and result.stderr.count("\n") == 1


def test_optimal_prints_the_table_the_fit_and_the_choice(tiny, tmp_path):
    out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
    result = invoke(
        "optimal",
        tiny,
        "--device",
        "sim:300KiB",
        "--max-batch-size",
        "64",
        "--timed-steps",
        "1",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    )
    assert result.exit_code == 0, result.output
    assert "Throughput" in result.output and "Fitted step time" in result.output and "Use batch size" in result.output
    document = json.loads(out_json.read_text())
    assert {1, 2, 4, 8, 16, 32, 64} <= {p["batch_size"] for p in document["points"]}
    assert document["batch_size"] in [p["batch_size"] for p in document["points"]]
    assert png_size(out_png) == (1000, 600)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["find", "mlp", "--max-trials", "1", "--no-trace", "--json", "."],
            "cannot write .: it is a folder; give a file path",
        ),
        (
            ["plan", "mlp", "--micro-batch-size", "8", "--global-batch-size", "64"],
            "give either --micro-batch-size N or a WORKLOAD",
        ),
        (["optimal", "mlp", "--max-batch-size", "-4"], "max_batch_size must be a positive integer, got -4"),
    ],
)
def test_more_user_errors_exit_2_without_a_traceback(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_a_zero_reserve_is_accepted_in_any_spelling():
    for reserve in ("0", "0MiB"):
        result = invoke("estimate", "mlp", "--gpu", "t4-16gb", "--reserve", reserve, "--quiet")
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "command",
    [
        ["find", "mlp", "--device", "sim:2MiB"],
        ["estimate", "mlp", "--batch-size", "8", "--gpu", "a100-40gb"],
        ["optimal", "mlp", "--device", "sim:2MiB"],
        ["plan", "mlp", "--device", "sim:2MiB", "--global-batch-size", "64"],
        ["critical", "mlp"],
    ],
    ids=lambda command: command[0],
)
def test_an_unwritable_json_path_fails_before_any_work(tmp_path, command):
    missing = tmp_path / "no-such-folder" / "out.json"
    result = runner.invoke(app, [*command, "--json", str(missing)])
    assert result.exit_code == 2
    assert f"folder {missing.parent} does not exist" in result.output
    assert len(result.output.strip().splitlines()) == 1  # the error alone: nothing was measured or printed first


def plan_answers(capacity: str, margin: int | str) -> tuple[int, int]:
    """The plain search's answer for ``mlp`` and, capped at it, the search's with gradients held."""
    import dataclasses

    import batchfit as bf
    from batchfit.cli.workloads import load_workload

    work = load_workload("mlp")
    plain = bf.search_workload(work, device=bf.SimulatedDevice(capacity), margin=margin).batch_size
    held = bf.search_workload(
        dataclasses.replace(work, accumulating=True),
        device=bf.SimulatedDevice(capacity),
        margin=margin,
        max_batch_size=plain,
    ).batch_size
    return plain, held


@pytest.mark.parametrize("margin", [0, "512KiB"])
def test_plan_on_a_workload_uses_the_micro_batch_measured_with_the_gradients_held(tmp_path, margin):
    plain, held = plan_answers("8MiB", margin)
    assert held < plain  # on this capacity the held gradients make a difference
    out = tmp_path / "plan.json"
    options = ["--margin", str(margin)] if margin else []
    result = invoke(
        "plan", "mlp", "--device", "sim:8MiB", "--global-batch-size", str(4 * held), *options, "--json", str(out)
    )
    assert result.exit_code == 0, result.output
    configuration = json.loads(out.read_text())["batch_configuration"]
    assert configuration["per_gpu_batch_size"] == held and configuration["gradient_accumulation_steps"] == 4
    assert configuration["max_micro_batch_size"] == held
    assert f"the largest micro-batch is {plain}." in result.output
    assert f"with the accumulation window's gradients held: the largest micro-batch is {held}." in " ".join(
        result.output.split()
    )


def test_plan_margin_reaches_the_search():
    assert plan_answers("8MiB", "512KiB")[0] < plan_answers("8MiB", 0)[0]
    plain = plan_answers("8MiB", "512KiB")[0]
    result = invoke("plan", "mlp", "--device", "sim:8MiB", "--global-batch-size", str(plain), "--margin", "512KiB")
    assert result.exit_code == 0, result.output
    assert f"the largest micro-batch is {plain}." in result.output and "gradients held" not in result.output


def test_only_what_the_user_can_fix_is_a_one_line_error(tiny, monkeypatch):
    # bad input batchfit checks: one line naming the fix, exit code 2, no traceback
    mistake = invoke("find", tiny, "--device", "sim:1MiB", "--margin", "2.5")
    assert mistake.exit_code == 2 and mistake.stderr.startswith("error: ") and "Traceback" not in mistake.stderr

    # a ValueError from inside batchfit that no check raised on purpose is a bug: traceback, report, exit 1
    def broken(*args, **kwargs):
        raise ValueError("internal: an index out of step")

    import batchfit.cli.find

    monkeypatch.setattr(batchfit.cli.find, "print_result", broken)
    bug = invoke("find", tiny, "--device", "sim:1MiB", "--max-trials", "1", "--no-trace")
    assert bug.exit_code == 1 and "error: internal" not in bug.stderr
    assert "Traceback" in bug.stderr and "ValueError: internal: an index out of step" in bug.stderr
    assert "please report it" in bug.stderr


def test_the_workloads_own_value_error_keeps_its_traceback(tmp_path):
    path = tmp_path / "raising_workload.py"
    path.write_text(textwrap.dedent(TINY) + "\n\ndef raising():\n    raise ValueError('my config has no width')\n")
    result = invoke("find", f"{path}:raising", "--device", "sim:1MiB")
    assert result.exit_code == 1 and not result.stderr.startswith("error: ")
    assert "raising_workload.py" in result.stderr and "ValueError: my config has no width" in result.stderr
