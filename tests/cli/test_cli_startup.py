"""The command line starts without the library's weight: help, the list of workloads and a plan from numbers load
no torch (each runs in a fresh interpreter here and reports what it imported). How long they take is in
benchmarks/CLI-STARTUP.md (``benchmarks/cli_startup.py``), not asserted."""

from __future__ import annotations

import subprocess
import sys

import pytest

PLAN = ["plan", "--micro-batch-size", "12", "--global-batch-tokens", "491520", "--seq-len", "1024", "--gpus", "8"]
PLAN_ONE = PLAN[:-2]  # no --gpus: the world size is read without importing torch.distributed
CODE = """
import sys
from batchfit.cli.app import app
try:
    app(sys.argv[1:])
except SystemExit as done:
    code = done.code
print("LOADED", " ".join(m for m in ("torch", "transformers", "matplotlib") if m in sys.modules), "EXIT", code)
"""


def loaded_by(*args: str) -> tuple[list[str], str]:
    run = subprocess.run([sys.executable, "-c", CODE, *args], capture_output=True, text=True, check=True)
    words = run.stdout.strip().splitlines()[-1].split()
    return words[1 : words.index("EXIT")], run.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["find", "--help"],
        ["estimate", "--help"],
        ["optimal", "--help"],
        ["plan", "--help"],
        ["tokens", "--help"],
        ["sweep", "--help"],
        ["critical", "--help"],
        ["cache", "list", "--help"],
        ["list-workloads"],
        PLAN,
        PLAN_ONE,
    ],
    ids=lambda args: " ".join(args[:2]),
)
def test_help_listing_and_a_plan_from_numbers_load_no_torch(args):
    loaded, output = loaded_by(*args)
    assert loaded == [], output
    assert "EXIT 0" in output or "EXIT None" in output


def test_the_list_still_names_every_built_in_with_its_docstring():
    from batchfit.cli.builtin_list import describe_builtins
    from batchfit.step.builtin_workloads import BUILTIN_WORKLOADS

    described = describe_builtins()
    assert list(described) == list(BUILTIN_WORKLOADS)
    for name, build in BUILTIN_WORKLOADS.items():
        assert described[name] == build.__doc__.strip().splitlines()[0].replace("``", "")


def test_the_plan_from_numbers_prints_what_it_did_before():
    _, output = loaded_by(*PLAN)
    assert "12 per device x 5 accumulation steps x 8 device(s) = 480 samples = 491,520" in " ".join(output.split())
