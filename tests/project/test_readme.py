"""Every command and Python snippet of the README and the docs runs, with small settings, and its
output is checked; how long each takes goes to ``benchmarks/README-TIMES.md`` (``benchmarks/readme_times.py``).

The commands run in-process through the CLI (as `batchfit` would), each distinct one once (the
same words in two documents run where first written), the snippets with the names they take for
granted (a model, a loader, ...) defined by a small preamble, all in a temporary folder where
``examples/`` is the repository's. Where a documented command needs a GPU or would compute for
minutes on two CPU cores, the tables below substitute smaller settings or, where nothing smaller
is the same command, skip it, each with its reason; every entry must still match a document, so a
stale one fails too, and a command in neither table runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchfit.cli.app import app
from readme_commands import DOCUMENTS
from readme_commands import REPO
from readme_commands import Block
from readme_commands import Command
from readme_commands import commands
from readme_commands import distinct
from readme_commands import fenced_blocks
from readme_commands import parse_command
from readme_commands import snippets

# How long each command and snippet takes is not asserted here (a busy machine is not a failure of batchfit):
# `python benchmarks/readme_times.py` times them all into benchmarks/README-TIMES.md.

# (pattern in a README command, replacement, why). Applied in order, each to every command.
COMMAND_SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    (
        r"--device sim:256MiB",
        "--device sim:16MiB",
        "trials compute for real on the CPU: the transformer's edge at 256 MiB takes tens of seconds of trials",
    ),
)

# Commands that are not run: (the command as written, why). Each must be a documented command. Times
# measured on this two-core machine, one torch thread, a second job beside it.
SHARDED_TEST = "tests/cli/test_cli_sharded.py runs the same options on a 2-layer Llama config at sequence 64"
SKIPPED_COMMANDS: tuple[tuple[str, str], ...] = (
    (
        "batchfit estimate llama-3-8b --gpu h100-80gb --gpus 8 --seq-len 4096 --param-dtype bf16 --reduce-dtype fp32"
        " --activation-checkpointing none,full",
        f"traces Llama-3-8B at 4096 tokens 7 times: 38 s of CPU, 56 s of wall time (near the 60 s bound); {SHARDED_TEST}",
    ),
    (
        "batchfit plan llama-3-8b --gpu h100-80gb --nodes 4 --gpus-per-node 8 --seq-len 4096 --global-batch-tokens 4M",
        "traces Llama-3-8B at 4096 tokens for both checkpointing choices, then with the gradient shards held:"
        f" 47 s of CPU, 126 s of wall time; {SHARDED_TEST}",
    ),
    (
        "batchfit estimate llama-3-70b --gpu h100-80gb --nodes 4 --gpus-per-node 8 --seq-len 4096 --param-dtype bf16"
        " --reduce-dtype fp32 --activation-checkpointing none,selective,full",
        f"traces Llama-3-70B at 4096 tokens 7 times: 87 s of CPU; {SHARDED_TEST}",
    ),
    (
        "batchfit plan examples/llama-100m.json --gpu 1GiB --gpus 64 --seq-len 256 --global-batch-tokens 256K"
        " --param-dtype bf16 --reduce-dtype fp32 --activation-checkpointing none --verify",
        "real training steps of a 100M-parameter model at 1,024 to 1,792 tokens, five trials: 77 s of CPU; the"
        " many-GPUs guide's plan --verify of a tiny Llama runs the same path",
    ),
    (
        "batchfit plan llama-3-8b --gpu h100-80gb --nodes 4 --gpus-per-node 8 --seq-len 4096 --global-batch-tokens 4M"
        " --param-dtype bf16 --reduce-dtype fp32",
        f"the plan above in bfloat16: 55 s of CPU, 94 s of wall time; {SHARDED_TEST}",
    ),
    (
        "batchfit estimate llama-3-8b --gpu h100-80gb --gpus 8 --seq-len 4096 --param-dtype bf16 --reduce-dtype fp32"
        " --activation-checkpointing none,selective,full --cpu-offload",
        "traces Llama-3-8B with CPU offload for three checkpointing choices in a child process: 61 s of CPU"
        " (benchmarks/OFFLOAD.md); tests/cli/test_cli_sharded.py runs --cpu-offload on a small Llama config",
    ),
)
SKIPPED_COMMANDS += (
    (
        "batchfit sweep gpt-tiny --grid seq_len=8,16 --grid layers=1,2 --device sim:32MiB --engine ray",
        "starts a Ray cluster and a fresh Ray worker per configuration: about 30 s; tests/sweep/test_engine_ray.py"
        " runs the same sweep through Ray (make reliability)",
    ),
)
OTHER_SHELL_LANGUAGES = {"sh", "shell", "zsh", "shell-session", "bash-session"}  # write ```bash or ```console

# (text in a README snippet, replacement, why); plain text, each must occur in some snippet.
SNIPPET_SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    (
        'trace_rank("llama-3-8b", 1, 4096,',
        'trace_rank({**LLM_PRESETS["llama-3-8b"], "num_hidden_layers": 2}, 1, 64,',
        "the same preset and code path, 2 of its 32 layers at 64 tokens: the whole 8B trace takes 9 s of CPU",
    ),
    (
        "TransformerEncoderLayer(512, 8, batch_first=True), num_layers=6)",
        "TransformerEncoderLayer(512, 8, batch_first=True), num_layers=2)",
        "2 of the 6 layers: a trace's cost is its ops, 7 s of CPU for the six-layer search",
    ),
)

# What every snippet takes for granted: the user's model, data and loss, made small.
USER_SETUP = """
from batchfit.parallel.models import LLM_PRESETS
import torch
import batchfit as bf
from torch.utils.data import DataLoader, TensorDataset

class MyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

torch.manual_seed(0)
_inputs = torch.randn(256, 32)
_data = TensorDataset(_inputs, _inputs[:, :10].argmax(dim=1))
train_loader = loader = DataLoader(_data, batch_size=64, shuffle=True)
make_loader = lambda batch_size: DataLoader(_data, batch_size=batch_size)
model = MyNet()
criterion = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
sample_batch = global_batch = next(iter(train_loader))
eval_batch = _inputs[:128]

import examples.my_exp
make_workload = examples.my_exp.make
evaluate = lambda *args: 0.5
"""

LIGHTNING_SETUP = """
import functools, types
import lightning
from lightning_models import Data, PlainClassifier

L = types.SimpleNamespace(Trainer=functools.partial(
    lightning.Trainer, accelerator="cpu", max_epochs=1, limit_train_batches=2, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False))
model, data = PlainClassifier(), Data()
"""

TRANSFORMERS_SETUP = """
from transformers import Trainer, TrainingArguments
from transformers.utils import logging as hf_logging
from examples.workloads import bert

hf_logging.set_verbosity_error()
model = bert(seq_len=16).model
_rows = [{"input_ids": ids, "attention_mask": [1] * 16, "labels": i % 2}
         for i, ids in enumerate(torch.randint(0, 1000, (256, 16)).tolist())]
train, val = _rows[:192], _rows[192:]
args = TrainingArguments(output_dir="hf", use_cpu=True, report_to="none", save_strategy="no",
                         logging_strategy="no", max_steps=1, per_device_train_batch_size=8)
"""

MLX_SETUP = """
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
x, y = mx.random.normal((8, 32)), mx.random.randint(0, 10, (8,))
loss = lambda out, y: nn.losses.cross_entropy(out, y, reduction="mean")
"""

TOKENS_SETUP = """
from batchfit.step.builtin_workloads import lm_tiny
_work = lm_tiny(seq_len=64)
model, sample_batch, optimizer = _work.model, _work.sample_batch, _work.optimizer
"""

# The heading a snippet sits under, and what its section assumes beyond USER_SETUP.
SECTION_SETUP = {
    "Token budgets in Python": TOKENS_SETUP,
    "Lightning": LIGHTNING_SETUP,
    "Hugging Face Transformers": TRANSFORMERS_SETUP,
    "MLX (Apple silicon, and Linux CPU)": MLX_SETUP,
}
# The optional packages a section's snippet, or a command naming a word, needs: without them it is skipped.
SECTION_NEEDS = {
    "Lightning": ("lightning",),
    "Hugging Face Transformers": ("transformers", "accelerate"),
    "MLX (Apple silicon, and Linux CPU)": ("mlx",),
}
COMMAND_NEEDS = {"mlx": ("mlx",), "workloads:bert": ("transformers",)}

runner = CliRunner()


def skipped_because(command: Command) -> str | None:
    """Why the command is not run, or ``None`` when it is."""
    return next((why for text, why in SKIPPED_COMMANDS if without_comment(command.text) == text), None)


def substituted(command: Command) -> Command:
    """The command with every substitution of the table applied."""
    text = without_comment(command.text)
    for pattern, replacement, _ in COMMAND_SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text)
    return parse_command(command.document, command.line, text)


def without_comment(text: str) -> str:
    return text.split(" #")[0].strip()


def prepared(block: Block) -> str:
    """The snippet's code with every snippet substitution applied."""
    code = block.text
    for text, replacement, _ in SNIPPET_SUBSTITUTIONS:
        code = code.replace(text, replacement)
    return code


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A temporary folder holding ``examples/`` (the repository's) and its own result cache, as the
    working directory. As for the `batchfit` script, neither it nor the repository is on ``sys.path``
    (``python -m pytest`` puts the working directory there, pytest the repository) and no ``examples``
    module is imported yet: a module path resolves only where the command's ``PYTHONPATH`` says."""
    (tmp_path / "examples").symlink_to(REPO / "examples", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path / "cache"))
    outside = [entry for entry in sys.path if entry not in ("", ".") and Path(entry).resolve() != REPO]
    monkeypatch.setattr(sys, "path", outside)
    for name in [name for name in sys.modules if name == "examples" or name.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def skip_without(packages: tuple[str, ...]) -> None:
    for package in packages:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed: the README says which extra installs it")


def test_every_table_entry_still_matches_a_document():
    texts = [command.text for command in commands()]
    for pattern, _, why in COMMAND_SUBSTITUTIONS:
        assert any(re.search(pattern, without_comment(text)) for text in texts), (pattern, why)
    code = "".join(block.text for block in snippets())
    for text, _, why in SNIPPET_SUBSTITUTIONS:
        assert text in code, (text, why)
    assert set(SECTION_SETUP) <= {block.heading for block in snippets()}
    documented = {without_comment(command.text) for command in commands()}
    for text, why in SKIPPED_COMMANDS:
        assert text in documented, (text, why)


def test_every_shell_block_is_one_whose_commands_run():
    for document in DOCUMENTS:
        for block in fenced_blocks(document):
            assert block.language not in OTHER_SHELL_LANGUAGES, (
                f"{block.document.name}:{block.line}: write ```bash or ```console"
            )


def test_a_console_block_runs_its_prompted_lines_and_a_repeated_command_runs_once(tmp_path):
    document = tmp_path / "guide.md"
    document.write_text(
        "```console\n$ batchfit find mlp \\\n    --device sim:8MiB\nLargest batch size ...\n```\n"
        "```bash\nbatchfit find mlp --device sim:8MiB   # again\nbatchfit plan --micro-batch-size 4\n```\n"
    )
    found = commands((document,))
    assert [(command.line, command.argv[1:]) for command in found] == [
        (2, ("find", "mlp", "--device", "sim:8MiB")),
        (7, ("find", "mlp", "--device", "sim:8MiB")),
        (8, ("plan", "--micro-batch-size", "4")),
    ]
    assert [command.line for command in distinct(found)] == [2, 8]


def test_every_command_is_batchfit_and_every_example_file_exists():
    for command in commands():
        assert command.argv[0] == "batchfit", f"{command.where}: {command.text}"
        for word in command.argv:
            path = word.split(":")[0]
            if path.startswith("examples."):  # module:function
                path = path.replace(".", "/") + ".py"
            if path.startswith("examples/"):
                assert (REPO / path).is_file(), f"{command.where}: {path} is not in the repository"


@pytest.mark.parametrize("command", distinct(commands()), ids=lambda command: f"{command.where} {command.argv[1]}")
def test_readme_command(command: Command, workdir):
    if why := skipped_because(command):
        pytest.skip(why)
    for word, packages in COMMAND_NEEDS.items():
        if word in command.text:
            skip_without(packages)
    run = substituted(command)
    for folder in reversed(run.env.get("PYTHONPATH", "").split(os.pathsep)):
        if folder:
            sys.path.insert(0, str((workdir / folder).resolve()))
    result = runner.invoke(app, list(run.argv[1:]), env={"COLUMNS": "200"})
    said = f"{command.where}: {' '.join(run.argv)}\n{result.output}\n{result.exception!r}"
    assert result.exit_code == 0, said
    assert "error" not in result.output.lower(), said  # a sweep exits 0 with a configuration's error in its table


@pytest.mark.parametrize("block", snippets(), ids=lambda block: f"{block.document.name}:{block.line}")
def test_readme_snippet(block: Block, workdir):
    skip_without(SECTION_NEEDS.get(block.heading, ()))
    sys.path.insert(0, str(workdir))  # the preamble imports examples/, as a script beside it would
    namespace: dict = {"__name__": "readme_snippet"}
    exec(USER_SETUP + SECTION_SETUP.get(block.heading, ""), namespace)
    code = compile("\n" * (block.line - 1) + prepared(block), str(block.document), "exec")
    exec(code, namespace)
