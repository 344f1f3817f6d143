"""Benchmark: how long every command and Python snippet of the README and the docs takes, as `make test` runs them.

`tests/project/test_readme.py` runs each documented command (in-process, with the small settings its tables
substitute) and each snippet, and checks what it prints; it asserts no time, since a busy machine is not a failure
of batchfit. This runs that file alone, one worker, and writes each one's seconds (pytest's `--durations`) beside
the bound the documentation promises (60 s), to benchmarks/README-TIMES.md.

    python benchmarks/readme_times.py
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
BOUND_SECONDS = 60.0
DURATION = re.compile(r"^\s*([\d.]+)s call\s+tests/project/test_readme\.py::(test_readme_\w+)\[(.+)\]\s*$")


def durations() -> list[tuple[str, str, float]]:
    """(kind, id, seconds) of every command and snippet test that ran."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--durations=0", "--durations-min=0"]
    done = subprocess.run(
        [*command, str(HERE.parent / "tests" / "project" / "test_readme.py")],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
    )
    if done.returncode != 0:
        raise SystemExit(done.stdout[-4000:] + done.stderr[-2000:])
    found = []
    for line in done.stdout.splitlines():
        match = DURATION.match(line)
        if match:
            seconds, test, ident = match.groups()
            found.append(("command" if test == "test_readme_command" else "snippet", ident, float(seconds)))
    return sorted(found, key=lambda row: -row[2])


def report(rows: list[tuple[str, str, float]], seconds: float) -> str:
    over = [row for row in rows if row[2] > BOUND_SECONDS]
    lines = [
        "# Every documented command and snippet, timed",
        "",
        f"Written by `python benchmarks/readme_times.py` on {time.strftime('%Y-%m-%d')} in {seconds:.0f} s, on a shared",
        f"two-core {platform.machine()} machine with no GPU, torch {torch.__version__}, one pytest worker. Each row is one",
        "documented command (run in-process, with the smaller settings `tests/project/test_readme.py` substitutes and",
        "says why) or Python snippet. The documentation promises each under 60 s here; `make test` checks what they",
        "print, not how long they take.",
        "",
        f"{len(rows)} timed, {len(over)} over 60 s; {sum(r[2] for r in rows):.0f} s in all.",
        "",
        "| kind | where | seconds | within 60 s |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {kind} | `{ident}` | {secs:.1f} | {'yes' if secs <= BOUND_SECONDS else 'no'} |"
        for kind, ident, secs in rows
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    started = time.time()
    rows = durations()
    from batchfit.files import atomic_write_text

    text = report(rows, time.time() - started)
    atomic_write_text(HERE / "README-TIMES.md", text)
    print(text)


if __name__ == "__main__":
    main()
