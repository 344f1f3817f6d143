"""Benchmark: what ``import batchfit`` costs beyond torch, warm and cold, for one or more source trees.

Each run is a fresh interpreter that imports torch, then times ``import batchfit`` alone and says whether sympy
came with it. *Warm*: the bytecode caches exist (the median of ``WARM_RUNS``). *Cold*: a fresh, empty
``PYTHONPYCACHEPREFIX``, so every module is compiled on the way, as on the first import after
``pip install --no-compile`` (the median of ``COLD_RUNS``; torch compiles too, but only batchfit's import is
timed). *Collected first*: warm, after a full garbage collection of what torch's import left (batchfit's own
cost: otherwise whichever import crosses the collector's threshold next pays for sweeping torch's objects).

    python benchmarks/import_time.py                          # this tree
    python benchmarks/import_time.py before=/tmp/old/src after=src   # label=src-folder, in that order

Writes benchmarks/IMPORT.md.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from batchfit.files import atomic_write_text

HERE = Path(__file__).parent
WARM_RUNS = 7
COLD_RUNS = 3
PROBE = (
    "import gc, sys, time, torch\n"
    "if sys.argv[1:] == ['collect']: gc.collect()\n"
    "start = time.perf_counter()\n"
    "import batchfit\n"
    "seconds = time.perf_counter() - start\n"
    "print(seconds, 'sympy' in sys.modules, len([m for m in sys.modules if m.startswith('batchfit')]))\n"
)


def one_run(src: Path, pycache: str | None, collect: bool = False) -> tuple[float, bool, int]:
    """One interpreter: the seconds of ``import batchfit`` after torch (and a full collection where ``collect``),
    whether sympy loaded, batchfit's modules."""
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = pycache
    command = [sys.executable, "-c", PROBE, *(["collect"] if collect else [])]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    seconds, sympy, modules = out.stdout.split()
    return float(seconds), sympy == "True", int(modules)


def measure(src: Path) -> dict[str, object]:
    one_run(src, None)  # writes the bytecode the warm runs read
    warm = [one_run(src, None) for _ in range(WARM_RUNS)]
    collected = [one_run(src, None, collect=True) for _ in range(WARM_RUNS)]
    cold = []
    for _ in range(COLD_RUNS):
        with tempfile.TemporaryDirectory() as empty:
            cold.append(one_run(src, empty))
    return {
        "warm_s": statistics.median(run[0] for run in warm),
        "cold_s": statistics.median(run[0] for run in cold),
        "collected_s": statistics.median(run[0] for run in collected),
        "sympy": warm[0][1],
        "modules": warm[0][2],
    }


def table(rows: dict[str, dict[str, object]]) -> str:
    lines = [
        f"| tree | `import batchfit` after torch, warm (median of {WARM_RUNS}) | cold (median of {COLD_RUNS}) "
        f"| collected first, warm (median of {WARM_RUNS}) | loads sympy | batchfit modules |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in rows.items():
        lines.append(
            f"| {label} | {row['warm_s']:.3f} s | {row['cold_s']:.2f} s | {row['collected_s']:.3f} s "
            f"| {'yes' if row['sympy'] else 'no'} | {row['modules']} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    trees = dict(arg.split("=", 1) for arg in argv) if argv else {"this tree": str(HERE.parent / "src")}
    started = time.time()
    rows = {label: measure(Path(src)) for label, src in trees.items()}
    text = f"""# `import batchfit`: what it costs beyond torch

Written by `python benchmarks/import_time.py` on {time.strftime("%Y-%m-%d")} ({time.time() - started:.0f} s), on a
shared two-core {platform.machine()} machine, Python {platform.python_version()}, torch {torch.__version__}.
Each run is a fresh interpreter that imports torch and then times `import batchfit` alone. *Warm*: bytecode
caches present. *Cold*: an empty `PYTHONPYCACHEPREFIX`, every module compiled on the way (the first import
after `pip install --no-compile`).

{table(rows)}

*Collected first*: warm, after `gc.collect()` following torch's import. That is batchfit's own cost. Without
it, whichever import next crosses the collector's threshold pays for a full sweep of torch's objects (about
70 ms on this machine). That sweep falls inside `import batchfit` or just after it, depending on how many
objects the import makes.

History: `import batchfit` once loaded sympy (about 470 modules) through one exception class,
`GuardOnDataDependentSymNode`, imported at module level from `torch.fx.experimental.symbolic_shapes`. The trace
now reads that class from `sys.modules` when it sorts an error: it can only have been raised once torch loaded
the module (0.325 s warm and 2.05 s cold before, 0.042 s and 0.16 s after). `tests/project/test_layout.py` keeps
sympy, rich, typer and the optional extras out of `import batchfit`.
"""
    atomic_write_text(HERE / "IMPORT.md", text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
