"""What a user sees after ``pip install batchfit``, checked in the virtual environment that runs this file.

    python .ci/smoke_install.py core            # no extras: every command, an answer, an estimate, bad input
    python .ci/smoke_install.py floors          # the checks the core's dependencies reach (help, find, bad input)
    python .ci/smoke_install.py plot            # [plot]: --plot writes a PNG
    python .ci/smoke_install.py transformers    # [transformers]: fit_trainer on a Trainer

Run by ``.ci/check_install`` from a temporary folder (never the repository root, whose ``src`` must not be
what is imported). Prints one line per check; exits 1 at the first that fails, with what it saw.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BATCHFIT = shutil.which("batchfit", path=str(Path(sys.executable).parent))
WORK = Path(tempfile.mkdtemp(prefix="batchfit-smoke-"))


class Failed(Exception):
    pass


def run(*args: str, expect_rc: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([BATCHFIT, *args], capture_output=True, text=True, cwd=WORK)
    if done.returncode != expect_rc:
        raise Failed(
            f"batchfit {' '.join(args)}: exit {done.returncode}, expected {expect_rc}\n{done.stdout}\n{done.stderr}"
        )
    return done


def python(code: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=WORK)
    if done.returncode != 0:
        raise Failed(f"python -c {code!r}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    lines = done.stderr.strip().splitlines()
    if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in done.stderr:
        raise Failed(f"expected one 'error: ...' line on stderr, got:\n{done.stderr}")
    missing = [needle for needle in needles if needle not in lines[0]]
    if missing:
        raise Failed(f"the error does not name {missing}: {lines[0]}")


def commands() -> list[list[str]]:
    """Every command and sub-command path of the ``batchfit`` app, read from the app itself."""
    code = (
        "import json, typer\n"
        "from batchfit.cli.app import app\n"
        "def walk(command, path):\n"
        "    subs = getattr(command, 'commands', {})\n"
        "    return [path] + [p for name, sub in sorted(subs.items()) for p in walk(sub, path + [name])]\n"
        "print(json.dumps(walk(typer.main.get_command(app), [])))\n"
    )
    return json.loads(python(code).stdout)


def helps(paths: list[list[str]]) -> None:
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # each call imports torch: 2-3 s
        for path, done in zip(paths, pool.map(lambda path: run(*path, "--help"), paths), strict=True):
            if "Usage" not in done.stdout:
                raise Failed(f"batchfit {' '.join(path)} --help printed no usage:\n{done.stdout}")


def check_help() -> str:
    paths = commands()
    top = {path[0] for path in paths if path}
    for expected in ("find", "estimate", "optimal", "plan", "sweep", "cache", "critical", "list-workloads"):
        if expected not in top:
            raise Failed(f"no {expected!r} command among {sorted(top)}")
    helps(paths)
    return f"--help of {len(paths)} commands and groups"


def check_top_help() -> str:
    """``batchfit --help`` converts every command's options (typer builds them all); ``find --help`` renders one."""
    helps([[], ["find"]])
    return "batchfit --help and batchfit find --help"


def check_find() -> str:
    run("find", "gpt-tiny", "--device", "sim:64MiB", "--json", "find.json")
    answer = json.loads((WORK / "find.json").read_text())
    size = answer["batch_size"]
    tried = {trial["batch_size"]: trial["fits"] for trial in answer["trials"]}
    if not (size >= 1 and tried.get(size) is True):
        raise Failed(f"find answered {size}, trials {tried}")
    return f"find gpt-tiny --device sim:64MiB: {size}, tried"


def check_estimate() -> str:
    run("estimate", "gpt-tiny", "--gpu", "a100-40gb", "--batch-size", "8", "--json", "estimate.json")
    estimate = json.loads((WORK / "estimate.json").read_text())["estimate"]
    if not (estimate["batch_size"] == 8 and estimate["peak_bytes"] > 0 and estimate["fits"]):
        raise Failed(f"estimate at 8: {estimate}")
    return f"estimate gpt-tiny --gpu a100-40gb --batch-size 8: {estimate['peak_bytes']} bytes, fits"


def check_bad_input() -> str:
    done = run("find", "gpt-tiny", "--device", "sim:1KiB", expect_rc=2)
    one_line_error(done, "larger capacity")
    return "find gpt-tiny --device sim:1KiB: exit 2, one line"


def check_extras_refused() -> str:
    done = run("find", "gpt-tiny", "--device", "sim:64MiB", "--plot", "out.png", expect_rc=2)
    one_line_error(done, "batchfit[plot]")
    code = "import batchfit.integrations.transformers"
    missing = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=WORK)
    if missing.returncode == 0 or "batchfit[transformers]" not in missing.stderr:
        raise Failed(f"the Trainer integration without its extra:\n{missing.stderr}")
    return "--plot and the Trainer integration without their extras name the extra"


def check_plot() -> str:
    run("find", "gpt-tiny", "--device", "sim:64MiB", "--plot", "out.png")
    if not (WORK / "out.png").read_bytes().startswith(b"\x89PNG"):
        raise Failed("--plot wrote no PNG")
    return "find --plot: a PNG"


TRAINER = """
import torch, batchfit as bf
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from batchfit.integrations.transformers import fit_trainer
torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 16)).tolist()]
args = TrainingArguments(output_dir="trainer", use_cpu=True, report_to="none", save_strategy="no", max_steps=2,
                         per_device_train_batch_size=4, gradient_accumulation_steps=4)
trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=rows)
fit = fit_trainer(trainer, device=bf.SimulatedDevice("16MiB"), trace=False)
assert fit.micro_batch_size * fit.gradient_accumulation_steps == 16, fit
assert trainer.args.per_device_train_batch_size == fit.micro_batch_size
trainer.train()
print(fit.micro_batch_size, fit.gradient_accumulation_steps)
"""


def check_transformers() -> str:
    micro, accumulation = python(TRAINER).stdout.split()[-2:]
    return f"fit_trainer: micro-batch {micro} x {accumulation} accumulation, then 2 training steps"


CHECKS: dict[str, list[Callable[[], str]]] = {
    "core": [check_help, check_find, check_estimate, check_bad_input, check_extras_refused],
    "floors": [check_top_help, check_find, check_bad_input],  # what typer, rich and numpy reach
    "plot": [check_plot],
    "transformers": [check_transformers],
}


def main(groups: list[str]) -> int:
    for group in groups:
        for check in CHECKS[group]:
            try:
                print(f"ok   {group}: {check()}", flush=True)
            except Failed as failure:
                print(f"FAIL {group}: {check.__name__}\n{failure}", flush=True)
                return 1
    shutil.rmtree(WORK, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["core"]))
