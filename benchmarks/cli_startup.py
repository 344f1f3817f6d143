"""Benchmark: how long the command line takes to answer what needs no model: help, the list of workloads, a plan
from numbers. Each command runs RUNS times in a fresh interpreter (``python -c "from batchfit.cli.app import app;
app()" ...``), the median wall time kept; Python's own start-up is timed the same way and shown beside. With
``--before-src DIR`` the same runs use another checkout's ``src`` too. Writes benchmarks/CLI-STARTUP.md.

    python benchmarks/cli_startup.py [--before-src /tmp/before/src]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
RUNS = 7
ENTRY = "import sys; from batchfit.cli.app import app; app(sys.argv[1:])"
COMMANDS = {
    "batchfit --help": ["--help"],
    "batchfit find --help": ["find", "--help"],
    "batchfit plan --help": ["plan", "--help"],
    "batchfit list-workloads": ["list-workloads"],
    "batchfit plan --micro-batch-size 12 --global-batch-tokens 491520 --seq-len 1024 --gpus 8": [
        "plan", "--micro-batch-size", "12", "--global-batch-tokens", "491520", "--seq-len", "1024", "--gpus", "8",
    ],
}  # fmt: skip


def median_seconds(argv: list[str], env: dict[str, str]) -> float:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timings(src: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src, "COLUMNS": "80"}
    found = {"python -c pass (start-up alone)": median_seconds([sys.executable, "-c", "pass"], env)}
    for name, args in COMMANDS.items():
        found[name] = median_seconds([sys.executable, "-c", ENTRY, *args], env)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before-src")
    args = parser.parse_args()
    now = timings(str(HERE.parent / "src"))
    before = timings(args.before_src) if args.before_src else None
    lines = [
        "# The command line's start-up",
        "",
        f"Written by `python benchmarks/cli_startup.py{' --before-src BEFORE/src' if before else ''}` on "
        f"{time.strftime('%Y-%m-%d')}, on a shared two-core {platform.machine()} machine, Python "
        f"{platform.python_version()}: the median of {RUNS} runs of each, every one in a fresh interpreter.",
        *(
            ["BEFORE is the checkout before the commands became light faces over lazily imported bodies (70589df)."]
            if before
            else []
        ),
        "",
        "| command | seconds now | beyond Python's start-up |" + (" seconds before |" if before else ""),
        "|---|---|---|" + ("---|" if before else ""),
    ]
    start = now["python -c pass (start-up alone)"]
    for name, seconds in now.items():
        row = f"| `{name}` | {seconds:.2f} | {seconds - start:.2f} |"
        lines.append(row + (f" {before[name]:.2f} |" if before else ""))
    text = "\n".join(lines) + "\n"
    from batchfit.files import atomic_write_text

    atomic_write_text(HERE / "CLI-STARTUP.md", text)
    print(text)


if __name__ == "__main__":
    main()
