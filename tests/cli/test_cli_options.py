"""Every option a command accepts is honoured or refused in one line: a table of options, each run beside the
same command without it, where the answer (or the JSON) must change, or the command must refuse it (exit 2).
Also: a workload file beside its own model module, run from its folder and from elsewhere; ``--set`` on a
factory with typed parameters; ``--quiet`` leaves stdout to the answer."""

from __future__ import annotations

import json
import textwrap

import pytest

from cli_runner import invoke
from cli_runner import refused

MODEL = """
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.body(x))
"""

WORKLOAD = """
import torch
import batchfit as bf
from model import Net

print("number of parameters: printed by the workload itself")


def build(width: int = 16, depth: int = 1, lr: float = 1e-3, bias: bool = True, name: str = "net",
          seed: int | None = None):
    if seed is not None:
        torch.manual_seed(seed)
    model = Net(width, depth)
    if not bias:
        model.head.bias = None
    sample = (torch.randn(4, width), torch.randint(0, 3, (4,)))
    return bf.Workload(model, sample, torch.nn.functional.cross_entropy,
                       torch.optim.AdamW(model.parameters(), lr=lr), name=name)
"""


@pytest.fixture
def beside(tmp_path):
    """A workload file that imports the module beside it, as nanoGPT's ``from model import GPT`` does."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "model.py").write_text(textwrap.dedent(MODEL))
    (folder / "work.py").write_text(textwrap.dedent(WORKLOAD))
    return folder


def answer(result) -> int:
    assert result.exit_code == 0, result.output
    return int(result.stdout.strip().splitlines()[-1])


# -- workload files import like scripts ---------------------------------------------------------------------


def test_a_workload_file_imports_the_module_beside_it_from_its_folder_and_from_elsewhere(beside, monkeypatch):
    monkeypatch.chdir(beside)
    here = answer(invoke("find", "work.py:build", "--device", "sim:1MiB", "--quiet"))
    monkeypatch.chdir(beside.parent)
    elsewhere = answer(invoke("find", "project/work.py:build", "--device", "sim:1MiB", "--quiet"))
    assert here == elsewhere > 0
    import sys

    assert str(beside) not in sys.path and str(beside.resolve()) not in sys.path  # put back as it was


def test_a_module_the_workload_imports_that_is_nowhere_is_one_line(tmp_path):
    (tmp_path / "lost.py").write_text("import model_that_is_nowhere\n\ndef build():\n    pass\n")
    refused(invoke("find", f"{tmp_path / 'lost.py'}:build"), "model_that_is_nowhere", "beside it")


def test_a_package_module_function_resolves_from_the_current_folder(tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(textwrap.dedent(MODEL))
    (package / "workloads.py").write_text(textwrap.dedent(WORKLOAD).replace("from model import", "from .model import"))
    monkeypatch.chdir(tmp_path)
    assert answer(invoke("find", "mypkg.workloads:build", "--device", "sim:1MiB", "--quiet")) > 0


# -- --set ----------------------------------------------------------------------------------------------------


def test_set_passes_typed_settings_to_the_factory(beside, tmp_path):
    out = tmp_path / "out.json"
    spec = f"{beside / 'work.py'}:build"
    plain = answer(invoke("find", spec, "--device", "sim:1MiB", "--quiet"))
    args = ["--set", "width=64", "--set", "depth=3", "--set", "bias=false", "--set", "name=wide", "--set", "seed=none"]
    result = invoke("find", spec, "--device", "sim:1MiB", *args, "--json", str(out))
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["workload"]["name"] == "wide"  # a str reached the factory
    assert document["workload"]["options"]["set"] == [a for a in args if a != "--set"]
    assert document["batch_size"] < plain  # 64 wide and 3 deep: fewer rows fit in the same megabyte


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("width=wide", ("width takes an int",)),
        ("lr=fast", ("lr takes a number",)),
        ("bias=maybe", ("bias takes true or false",)),
        ("heads=4", ("no setting heads", "it takes width, depth, lr, bias, name, seed")),
        ("=4", ("is not KEY=VALUE",)),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_fix(beside, setting, words):
    refused(invoke("find", f"{beside / 'work.py'}:build", "--device", "sim:1MiB", "--set", setting), *words)


def test_set_is_refused_for_a_model_built_from_its_config():
    refused(invoke("estimate", "llama-tiny", "--gpu", "a100-40gb", "--gpus", "2", "--set", "x=1"), "--set")


# -- stdout is batchfit's ---------------------------------------------------------------------------------------


def test_quiet_stdout_is_the_answer_alone_and_the_workloads_prints_go_to_stderr(beside):
    spec = f"{beside / 'work.py'}:build"
    for command in (["find", spec, "--device", "sim:1MiB"], ["estimate", spec, "--capacity", "1MiB"]):
        result = invoke(*command, "--quiet")
        assert result.exit_code == 0, result.output
        assert result.stdout.strip().isdigit(), result.stdout
        assert "number of parameters" in result.stderr


# -- the options table ------------------------------------------------------------------------------------------

PLAN = ["plan", "--micro-batch-size", "12", "--global-batch-tokens", "491520", "--seq-len", "1024"]


def plan_json(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    result = invoke(*PLAN, *args, "--json", str(out))
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())["batch_configuration"]


def test_plan_spreads_over_the_gpus_asked_for_by_either_name(tmp_path):
    one = plan_json(tmp_path)
    by_gpus = plan_json(tmp_path, "--gpus", "8")
    by_devices = plan_json(tmp_path, "--devices", "8")
    by_nodes = plan_json(tmp_path, "--nodes", "2", "--gpus-per-node", "4")
    assert (one["devices"], one["gradient_accumulation_steps"]) == (1, 40)  # nanoGPT's 12 x 40 x 1
    assert by_gpus == by_devices == by_nodes
    assert (by_gpus["devices"], by_gpus["gradient_accumulation_steps"]) == (8, 5)  # nanoGPT's 12 x 5 x 8
    refused(invoke(*PLAN, "--gpus", "8", "--devices", "4"), "--devices 4", "8 GPUs")


@pytest.mark.parametrize(
    "extra",
    [
        ["--gpu", "a100-40gb"],
        ["--device", "sim:1GiB"],
        ["--margin", "0.1"],
        ["--drop-output"],
        ["--activation-checkpointing", "full"],
        ["--gpus", "8", "--fsdp"],
        ["--gpus", "8", "--cpu-offload"],
        ["--gpus", "8", "--param-dtype", "bf16"],
    ],
)
def test_a_plan_without_a_workload_refuses_what_only_a_workload_reads(extra):
    refused(invoke(*PLAN, *extra), extra[-1] if extra[-1].startswith("--") else extra[-2], "WORKLOAD")


def test_plan_of_a_workload_for_a_gpu_traces_it_there(tmp_path):
    estimated = answer(invoke("estimate", "mlp", "--gpu", "a100-40gb", "--margin", "0", "--quiet"))
    out = tmp_path / "plan.json"
    result = invoke("plan", "mlp", "--gpu", "a100-40gb", "--global-batch-size", str(4 * estimated), "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "nothing runs on a GPU" in result.stdout
    planned = json.loads(out.read_text())["batch_configuration"]
    assert planned["max_micro_batch_size"] == estimated  # the traced answer, not the default simulated device's
    refused(
        invoke("plan", "mlp", "--gpu", "a100-40gb", "--device", "sim:1GiB", "--global-batch-size", "64"), "not both"
    )


def test_a_gpu_preset_given_as_a_device_is_refused_before_the_workload_is_built(tmp_path):
    marker = tmp_path / "built"
    (tmp_path / "slow.py").write_text(f"def build():\n    open({str(marker)!r}, 'w').close()\n")
    for command in ("find", "optimal", "tokens"):
        refused(invoke(command, f"{tmp_path / 'slow.py'}:build", "--device", "a100-40gb"), "--gpu a100-40gb")
    assert not marker.exists()


def estimate_answer(*args: str) -> int:
    return answer(invoke("estimate", *args, "--quiet"))


@pytest.mark.slow  # eleven traces of gpt-tiny, one per option: about 10 s (make reliability)
def test_estimate_options_each_change_the_answer_or_are_refused():
    base = ["gpt-tiny", "--capacity", "32MiB", "--margin", "0"]
    plain = estimate_answer(*base)
    assert estimate_answer(*base[:-1], "0.2") < plain  # --margin
    assert estimate_answer(*base, "--allocator", "cuda") < plain  # fragmentation, modelled
    assert estimate_answer(*base, "--seq-len", "128") < plain
    assert estimate_answer(*base, "--drop-output") > plain  # the logits die inside the loss
    assert estimate_answer("mlp", "--capacity", "8MiB", "--accumulating") < estimate_answer("mlp", "--capacity", "8MiB")
    on_a_gpu = ["gpt-tiny", "--gpu", "a100-40gb"]
    assert estimate_answer(*on_a_gpu, "--reserve", "10GiB") < estimate_answer(*on_a_gpu)
    refused(invoke("estimate", *base, "--reserve", "1GiB"), "--reserve", "--gpu")
    for extra in (["--margin", "0.1"], ["--accumulating"]):
        refused(invoke("estimate", *on_a_gpu, "--gpus", "2", *extra), extra[0], "per rank")
    refused(invoke("estimate", "llama-tiny", "--gpu", "a100-40gb", "--gpus", "2", "--reserve", "1GiB"), "--reserve")


def test_an_estimate_that_rests_on_an_uncounted_workspace_leaves_headroom_and_says_so():
    result = invoke("estimate", "cnn-small", "--gpu", "a100-40gb")
    assert result.exit_code == 0, result.output
    assert "The answer leaves 1.9 GiB of 38.8 GiB free: for what only the card sizes (cuDNN" in result.stdout
    assert estimate_answer("cnn-small", "--gpu", "a100-40gb") < estimate_answer(
        "cnn-small", "--gpu", "a100-40gb", "--margin", "0"
    )
    assert "leaves" not in invoke("estimate", "gpt-tiny", "--gpu", "a100-40gb").stdout  # nothing uncounted


def test_a_plan_says_why_its_micro_batch_is_smaller_than_the_one_that_fits():
    result = invoke(
        "plan", "--micro-batch-size", "12", "--global-batch-tokens", "0.5M", "--seq-len", "1024", "--gpus", "8"
    )
    assert result.exit_code == 0, result.output
    assert "the micro-batch is 8, not the 12 that fits" in " ".join(result.stdout.split())


def test_optimal_prints_each_size_as_it_is_timed_and_takes_a_time_limit():
    result = invoke("optimal", "mlp", "--device", "sim:8MiB", "--max-batch-size", "16", "--max-seconds", "600")
    assert result.exit_code == 0, result.output
    timed = [line for line in result.stdout.splitlines() if line.startswith("Batch size ") and "samples/s (" in line]
    assert [int(line.split()[2].rstrip(":")) for line in timed][:3] == [1, 2, 4]  # the geometric grid, in order
    for bad in ("0", "-1", "nan"):
        refused(invoke("optimal", "mlp", "--device", "sim:8MiB", "--max-seconds", bad), "max_seconds")
