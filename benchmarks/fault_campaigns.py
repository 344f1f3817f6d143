"""Fault campaigns beyond the core: an OOM inside FSDP2, the result cache against edits, Ctrl-C at seeded sites.

- **fsdp2** (``tests/support/fault_campaigns.py``): one rank of 2 and of 4 (FSDP2 over torch's fake process group), an
  out-of-memory error raised at a seeded op of a trial's step; holds when the next trial is a fresh prober's.

- **cache**: per seed, a search cached, then one edit of what decides memory (a
  forward's code, a child's, a helper its forward calls, a plain attribute, a checkpointing flag, a loss's
  captured value, a simulated device's rounding) and the same search again. Holds when the edited search is
  measured, not served, and answers what an uncached search answers; with no edit it must be served.
- **interrupt**: a real SIGINT at a seeded site (inside the accounting's weak-reference callback, at an op a
  counting device sees, at an op of a trace). Holds when ``KeyboardInterrupt`` comes out, the model and
  optimizer are bitwise as before, no dispatch mode is left pushed, Python's SIGINT handler is back and the next
  search finds the clean answer.

Writes ``benchmarks/FAULTS.md`` and ``benchmarks/faults.json``; exits with 1 when any case broke.

    make reliability      # or: python benchmarks/fault_campaigns.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

import batchfit as bf
from batchfit.files import atomic_write_text

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
from fault_campaigns import SITES  # noqa: E402
from fault_campaigns import Tally  # noqa: E402
from fault_campaigns import cache_campaign  # noqa: E402
from fault_campaigns import cache_edits  # noqa: E402
from fault_campaigns import fsdp_campaign  # noqa: E402
from fault_campaigns import interrupt_campaign  # noqa: E402

CACHE_SEEDS, INTERRUPT_SEEDS, FSDP_SEEDS = 12, 30, 200
QUICK_CACHE_SEEDS, QUICK_INTERRUPT_SEEDS, QUICK_FSDP_SEEDS = 2, 3, 12
FSDP_WORLD_SIZES = (2, 4)


def log(line: str) -> None:
    print(line, flush=True)


def _row(name: str, tally: Tally, seconds: float, what: str) -> str:
    return f"| {name} | {what} | {tally.tried} | {tally.held} | {tally.broke} | {seconds:.0f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seeds of each campaign")
    args = parser.parse_args()
    cache_seeds = QUICK_CACHE_SEEDS if args.quick else CACHE_SEEDS
    interrupt_seeds = QUICK_INTERRUPT_SEEDS if args.quick else INTERRUPT_SEEDS
    fsdp_seeds = QUICK_FSDP_SEEDS if args.quick else FSDP_SEEDS
    results: dict[str, tuple[Tally, float]] = {}
    phases: dict[int, set[str]] = {}
    for world_size in FSDP_WORLD_SIZES:
        start = time.perf_counter()
        tally, phases[world_size] = fsdp_campaign(world_size, range(fsdp_seeds))
        results[f"fsdp2, {world_size} ranks"] = (tally, time.perf_counter() - start)
        log(f"fsdp2 at {world_size} ranks: {tally}")
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        results["cache"] = (cache_campaign(range(cache_seeds), Path(folder)), time.perf_counter() - start)
        log(f"cache: {results['cache'][0]}")
    start = time.perf_counter()
    results["interrupt"] = (interrupt_campaign(range(interrupt_seeds)), time.perf_counter() - start)
    log(f"interrupt: {results['interrupt'][0]}")
    cache, interrupt = results["cache"], results["interrupt"]
    lines = [
        "# Fault campaigns: an OOM inside FSDP2, the cache against edits, Ctrl-C at seeded sites",
        "",
        f"batchfit {bf.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, CPU only. `python benchmarks/fault_campaigns.py` "
        "(part of `make reliability`); the cases are `tests/support/fault_campaigns.py`, a few of each run in "
        "`make test` (`tests/project/test_fault_campaigns.py`).",
        "",
        "| campaign | cases | tried | held | broke | seconds |",
        "|---|---|---:|---:|---:|---:|",
        *(
            _row(
                f"OOM inside FSDP2, {size} ranks",
                results[f"fsdp2, {size} ranks"][0],
                results[f"fsdp2, {size} ranks"][1],
                f"{fsdp_seeds} seeded ops of one rank's step (phases hit: {', '.join(sorted(p for p in phases[size] if p))})",
            )
            for size in FSDP_WORLD_SIZES
        ),
        _row(
            "cache",
            cache[0],
            cache[1],
            f"{cache_seeds} seeds x (no edit + {len(cache_edits())} edits: {', '.join(cache_edits())})",
        ),
        _row(
            "interrupt", interrupt[0], interrupt[1], f"{interrupt_seeds} seeds x {len(SITES)} sites: {', '.join(SITES)}"
        ),
        "",
        "An FSDP2 case (one rank over torch's fake process group, a small transformer, AdamW, 2 steps a trial) "
        "raises `torch.OutOfMemoryError` (one in three: a `RuntimeError` with CUDA's wording) before or after a "
        "seeded op of the step, anywhere in it (the batch's copy, forward, FSDP2's all-gathers and hooks, backward, "
        "the reduce-scatters, AdamW); it holds when that trial fails as out of memory and the next trial on the same "
        "prober is a fresh prober's (fits, same peak) with nothing left counted. Under `torchrun` (gloo) a rank's "
        "sharded step runs on to its end before its OOM is raised (its peers wait in its collectives): "
        "`tests/parallel/test_fsdp_find.py` (slow) checks both ranks agree there.",
        "",
        "A cache case holds when an edited workload is measured again (never served) and answers what an uncached "
        "search answers, and an unedited one is served. An interrupt case holds when a real SIGINT at the seeded "
        "call (drawn from the calls a clean, warm search makes at that site) raises `KeyboardInterrupt`, the model "
        "and optimizer are bitwise as before, no dispatch mode is left pushed, Python's handler is back, and the "
        "next search finds the clean answer.",
    ]
    broken = [case for tally, _ in results.values() for case in tally.broken]
    if broken:
        lines += ["", "Broken (first five of each campaign):", "", *(f"- {case}" for case in broken)]
    here = HERE / "FAULTS.md"
    atomic_write_text(here, "\n".join(lines) + "\n")
    summary = {name: {"tried": t.tried, "held": t.held, "broke": t.broke, "broken": t.broken, "seconds": round(s, 1)}
               for name, (t, s) in results.items()}  # fmt: skip
    atomic_write_text(HERE / "faults.json", json.dumps(summary, indent=2) + "\n")
    log(f"wrote {here}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
