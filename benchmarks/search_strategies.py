"""Benchmark: every search strategy on the same workloads and simulated capacities.

For each (workload, capacity): the true largest batch (a linear scan, cached in
benchmarks/true_edges.json so it is computed once), then per strategy: the size found,
found/true, trials, OOM trials, training steps executed and wall seconds. Writes
benchmarks/SEARCH.md and benchmarks/search.json.

    make bench            # or: python benchmarks/search_strategies.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import batchfit as bf
from batchfit.files import atomic_write_text
from batchfit.search.prober import Prober
from batchfit.step.builtin_workloads import cnn_small
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.builtin_workloads import mlp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
from models import cnn_bn  # noqa: E402
from models import dict_model  # noqa: E402
from models import mlp_tuple  # noqa: E402
from models import transformer  # noqa: E402

CAP = 512  # the classic bisection's max_batch_size, given to every strategy alike
# (label, strategy, trace): `auto` with its default trace="auto" decides from what a trial costs; the two
# others force the trace on fake tensors first, or no trace
METHODS = [
    ("auto", "auto", "auto"),
    ("auto, trace first", "auto", True),
    ("auto, no trace", "auto", False),
    ("power", "power", False),
    ("binary", "binary", False),
    ("grow", "grow", False),
    ("halving", "halving", False),
]
WORKLOADS: list[tuple[str, Callable[[], bf.Workload], list[str]]] = [
    ("mlp (tuple, Adam)", mlp_tuple, ["160KiB", "192KiB", "256KiB"]),
    ("cnn (BatchNorm, SGD)", cnn_bn, ["400KiB", "1MiB", "2MiB"]),
    ("transformer (AdamW)", transformer, ["1MiB", "2MiB", "4MiB"]),
    ("dict model (Adam)", dict_model, ["160KiB", "224KiB", "320KiB"]),
    ("gpt-tiny (built-in)", gpt_tiny, ["40MiB"]),
    ("cnn-small (built-in)", cnn_small, ["40MiB"]),
    ("mlp (built-in)", mlp, ["7.5MiB"]),
]


def true_edge(build: Callable[[], bf.Workload], capacity: str) -> int:
    """Linear scan: probe 1, 2, 3, ... until the first failure (monotone by construction)."""
    device = bf.SimulatedDevice(capacity)
    with Prober(build(), device, limit_bytes=device.capacity_bytes()) as prober:
        size = 1
        while size <= CAP and prober.probe(size).fits:
            size += 1
    return size - 1


def cached_true_edges() -> dict[str, int]:
    path = HERE / "true_edges.json"
    edges = json.loads(path.read_text()) if path.exists() else {}
    changed = False
    for _name, build, capacities in WORKLOADS:
        for capacity in capacities:
            key = f"{build.__module__}.{build.__name__}@{capacity}/torch{torch.__version__}"
            if key not in edges:
                print(f"linear scan for {key} ...", flush=True)
                edges[key] = true_edge(build, capacity)
                changed = True
    if changed:
        atomic_write_text(path, json.dumps(edges, indent=1, sort_keys=True) + "\n")
    return edges


def run() -> list[dict]:
    edges = cached_true_edges()
    rows = []
    for name, build, capacities in WORKLOADS:
        for capacity in capacities:
            truth = edges[f"{build.__module__}.{build.__name__}@{capacity}/torch{torch.__version__}"]
            for label, strategy, trace in METHODS:
                device = bf.SimulatedDevice(capacity)
                result = bf.search_workload(build(), device=device, strategy=strategy, max_batch_size=CAP, trace=trace)
                rows.append(
                    {
                        "workload": name,
                        "capacity": capacity,
                        "strategy": label,
                        "true": truth,
                        "found": result.batch_size,
                        "trials": len(result.trials),
                        "oom_trials": result.oom_trials,
                        "steps": result.steps,
                        "seconds": result.seconds,
                        "sizes": [t.batch_size for t in result.trials],
                    }
                )
                print(
                    f"{name:24} {capacity:>7} {strategy:8} {result.batch_size:4}/{truth:<4} {len(result.trials):2} trials",
                    flush=True,
                )
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = [
        "| strategy | exact | median trials | worst trials | median OOM trials | median time vs auto |",
        "|---|---|---|---|---|---|",
    ]
    auto_time = {(r["workload"], r["capacity"]): r["seconds"] for r in rows if r["strategy"] == "auto"}
    for strategy, _, _ in METHODS:
        mine = [r for r in rows if r["strategy"] == strategy]
        exact = sum(r["found"] == r["true"] for r in mine)
        ratio = statistics.median(r["seconds"] / auto_time[(r["workload"], r["capacity"])] for r in mine)
        lines.append(
            f"| {strategy} | {exact}/{len(mine)} | {statistics.median(r['trials'] for r in mine):g} | "
            f"{max(r['trials'] for r in mine)} | {statistics.median(r['oom_trials'] for r in mine):g} | {ratio:.2f}x |"
        )
    return lines


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| workload | capacity | strategy | found/true | trials | OOM | steps | seconds | sizes tried |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['capacity']} | {r['strategy']} | {r['found']}/{r['true']} | {r['trials']} | "
            f"{r['oom_trials']} | {r['steps']} | {r['seconds']:.2f} | {' '.join(map(str, r['sizes']))} |"
        )
    return lines


def main() -> None:
    rows = run()
    text = "\n".join(
        [
            "# Search strategies side by side",
            "",
            f"Generated by `make bench` (`python benchmarks/search_strategies.py`) with torch {torch.__version__} on "
            f"{os.cpu_count()} CPU cores, on `SimulatedDevice` (real CPU compute, 512-byte allocator rounding). "
            f"Every strategy gets `max_batch_size={CAP}` (the classic bisection's cap). `true` is a linear scan. Trials are real "
            'trials on the device. `auto` is the default (`trace="auto"`: here, where trials are cheap, it starts with '
            "real trials at 2 and 3 and reads the edge off their lines); `auto, trace first` (`trace=True`) estimates "
            "the edge on fake tensors first, and its wall time includes that trace (on these small CPU models tracing "
            "costs more than the real trials it saves; on a GPU real trials are the expensive part). Wall times are "
            "one run each on a shared machine: read them as ratios, not absolutes.",
            "",
            "## Summary",
            "",
            *summary(rows),
            "",
            "## Every run",
            "",
            *table(rows),
            "",
        ]
    )
    atomic_write_text(HERE / "SEARCH.md", text)
    atomic_write_text(HERE / "search.json", json.dumps(rows, indent=1) + "\n")
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
