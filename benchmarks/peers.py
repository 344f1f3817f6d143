"""Benchmark: batchfit against the peers users would otherwise pick, on the same work, in one run.

For each case (a workload on a simulated capacity; bench_workloads.CASES): the true largest batch
(a linear scan, cached in benchmarks/true_edges.json), then for each method (peer_methods): the
size found, found/true, trials, OOM trials, training steps, wall seconds, and whether 20 real
training steps at the size found then run without an OOM, every byte counted. Writes
benchmarks/RESULTS.md and benchmarks/results.json (atomically).

    make bench            # or: .venv/bin/python benchmarks/peers.py   (needs lightning and accelerate)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

import batchfit as bf
from batchfit.files import atomic_write_text
from batchfit.step.builtin_workloads import mlp

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from bench_workloads import CASES  # noqa: E402
from bench_workloads import Case  # noqa: E402
from bench_workloads import true_edges  # noqa: E402
from peer_methods import CHECK_STEPS  # noqa: E402
from peer_methods import CLASSIC_MAX  # noqa: E402
from peer_methods import GROW_ATTEMPTS  # noqa: E402
from peer_methods import GROW_START  # noqa: E402
from peer_methods import STEPS_PER_CALL  # noqa: E402
from peer_methods import accelerate_method  # noqa: E402
from peer_methods import batchfit_method  # noqa: E402
from peer_methods import lightning_method  # noqa: E402
from peer_methods import runs_steps  # noqa: E402
from peer_methods import ultralytics_style  # noqa: E402
from peers_report import write_report  # noqa: E402

DEFAULT, AUTO, NO_TRACE = "batchfit auto (default)", "batchfit auto, trace first", "batchfit auto, no trace"
METHODS = [
    (DEFAULT, batchfit_method("auto", trace="auto")),  # the trace first where a trial is expensive: not here
    (AUTO, batchfit_method("auto", trace=True)),
    (NO_TRACE, batchfit_method("auto")),
    ("batchfit power", batchfit_method("power")),
    ("binary (max 512)", batchfit_method("binary", max_batch_size=CLASSIC_MAX)),
    ("grow (from 32, 5 attempts)", batchfit_method("grow", max_batch_size=CLASSIC_MAX, max_trials=GROW_ATTEMPTS)),
    ("Lightning power", lightning_method("power")),
    ("Lightning binsearch", lightning_method("binsearch")),
    ("Lightning binsearch, margin 0", lightning_method("binsearch", margin=0.0)),
    ("accelerate from 128", accelerate_method(128)),
    ("accelerate from 1024", accelerate_method(1024)),
    ("Ultralytics-style 60%", ultralytics_style),
]
WARM_UP = Case("warm-up", mlp, "6MiB")  # cheap; its results are not recorded
PEERS = [name for name, _ in METHODS if not name.startswith(("batchfit", "binary", "grow"))]


def warm_up(case: Case) -> None:
    """Run one method of each kind once, unrecorded, so none pays the process's first-call costs
    (imports, Lightning's first fit, dispatch and fake-tensor set-up) in the timed runs."""
    for name, method in METHODS:
        if name in (AUTO, "Lightning power", "accelerate from 128", "Ultralytics-style 60%"):
            method(case)


def run_case(case: Case, truth: int, checked: dict[tuple[str, int], bool]) -> list[dict]:
    rows = []
    for name, method in METHODS:
        run = method(case)
        if run.found is not None and (case.key, run.found) not in checked:
            checked[(case.key, run.found)] = runs_steps(case, run.found)
        row = {
            "workload": case.label,
            "capacity": case.capacity,
            "method": name,
            "true": truth,
            "found": run.found,
            "found_over_true": None if run.found is None else round(run.found / truth, 4),
            "trials": len(run.tally.sizes),
            "oom_trials": run.tally.ooms,
            "steps": run.tally.steps,
            "seconds": round(run.seconds, 4),
            "twenty_steps_ok": None if run.found is None else checked[(case.key, run.found)],
            "answer_was_tested": run.tested,
            "sizes": run.tally.sizes,
            **{key: value for key, value in run.extra.items() if value is not None},
        }
        rows.append(row)
        line = f"{case.label:22} {case.capacity:>7} {name:30} {run.found!s:>5}/{truth:<5} {row['trials']:3} trials "
        print(f"{line}{row['oom_trials']:3} OOM {run.seconds:7.2f} s  20 steps: {row['twenty_steps_ok']}", flush=True)
    return rows


def environment(started: float, load_at_start: list[float]) -> dict:
    import accelerate
    import lightning

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)),
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPU cores "
        f"({cpu}), {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM, no GPU",
        "load_average_at_start": load_at_start,
        "python": platform.python_version(),
        "versions": {
            "batchfit": bf.__version__,
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "accelerate": accelerate.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "git": git_state(),
        "command": "make bench  (.venv/bin/python benchmarks/peers.py)",
    }


def git_state() -> str:
    """The commit the run measured, and whether the working tree had changes on top of it."""

    def git(*args: str) -> str:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "--", "src")
    return f"{git('rev-parse', '--short', 'HEAD') or 'unknown'}{' + uncommitted changes in src/' if changed else ''}"


def oom_wording() -> dict:
    """Whether the installed peers' own OOM matchers accept the simulated device's OOM."""
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    device = bf.SimulatedDevice(1024)
    try:
        with device.measuring():
            torch.zeros(4096)
    except torch.OutOfMemoryError as error:
        return {
            "message": str(error),
            "lightning_is_oom_error": is_oom_error(error),
            "accelerate_should_reduce_batch_size": should_reduce_batch_size(error),
        }
    raise AssertionError("the simulated device did not raise an OOM past its capacity")


def summarize(rows: list[dict]) -> list[dict]:
    auto_seconds = {(r["workload"], r["capacity"]): r["seconds"] for r in rows if r["method"] == AUTO}
    no_trace_seconds = {(r["workload"], r["capacity"]): r["seconds"] for r in rows if r["method"] == NO_TRACE}
    summary = []
    for name, _ in METHODS:
        mine = [r for r in rows if r["method"] == name]
        ratios = [r["found_over_true"] or 0.0 for r in mine]
        summary.append(
            {
                "method": name,
                "cases": len(mine),
                "exact": sum(r["found"] == r["true"] for r in mine),
                "median_found_over_true": statistics.median(ratios),
                "worst_found_over_true": min(ratios),
                "median_trials": statistics.median(r["trials"] for r in mine),
                "worst_trials": max(r["trials"] for r in mine),
                "median_oom_trials": statistics.median(r["oom_trials"] for r in mine),
                "median_steps": statistics.median(r["steps"] for r in mine),
                "median_seconds": statistics.median(r["seconds"] for r in mine),
                "twenty_step_failures": sum(r["twenty_steps_ok"] is False for r in mine),
                "no_answer": sum(r["found"] is None for r in mine),
                "untested_answers": sum(r["answer_was_tested"] is False for r in mine),
                "auto_time_ratio": statistics.median(
                    auto_seconds[(r["workload"], r["capacity"])] / r["seconds"] for r in mine if r["found"] is not None
                ),
                "auto_time_ratio_range": _range(
                    auto_seconds[(r["workload"], r["capacity"])] / r["seconds"] for r in mine if r["found"] is not None
                ),
                "no_trace_time_ratio": statistics.median(
                    no_trace_seconds[(r["workload"], r["capacity"])] / r["seconds"]
                    for r in mine
                    if r["found"] is not None
                ),
            }
        )
    return summary


def _range(values: Iterable[float]) -> tuple[float, float]:
    values = list(values)
    return min(values), max(values)


def targets(summary: list[dict]) -> list[dict]:
    """The issue's targets for ``auto``, each with the measured value and whether it is met."""
    auto = next(s for s in summary if s["method"] == AUTO)
    binsearch = next(s for s in summary if s["method"] == "Lightning binsearch")
    no_trace, low, high = binsearch["no_trace_time_ratio"], *binsearch["auto_time_ratio_range"]
    return [
        {
            "target": "exact edge on every case",
            "value": f"{auto['exact']}/{auto['cases']}",
            "met": auto["exact"] == auto["cases"],
        },
        {"target": "median trials <= 4", "value": auto["median_trials"], "met": auto["median_trials"] <= 4},
        {"target": "median OOM trials <= 1", "value": auto["median_oom_trials"], "met": auto["median_oom_trials"] <= 1},
        {
            "target": "zero failures in the 20-step check",
            "value": auto["twenty_step_failures"],
            "met": auto["twenty_step_failures"] == 0,
        },
        {
            "target": "wall time < 1/3 of Lightning binsearch (median of per-case ratios)",
            "value": round(binsearch["auto_time_ratio"], 3),
            "met": binsearch["auto_time_ratio"] < 1 / 3,
            "context": f"per case {low:.2f} to {high:.2f}; without its trace (trace=False) auto takes {no_trace:.3f}",
        },
    ]


def require_peers() -> None:
    """Stop with one line if a peer is not installed in this environment."""
    import importlib.util

    missing = [name for name in ("lightning", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"benchmarks/peers.py needs {' and '.join(missing)}: pip install 'batchfit[bench]'")


def main() -> None:
    require_peers()
    torch.set_num_threads(1)  # timings on a shared 2-core machine: one thread is stable, two thrash
    started, load_at_start = time.time(), [round(x, 2) for x in os.getloadavg()]
    edges = true_edges(CASES)
    bench_start = time.perf_counter()
    warm_up(WARM_UP)
    rows: list[dict] = []
    checked: dict[tuple[str, int], bool] = {}
    for case in CASES:
        rows += run_case(case, edges[case.key], checked)
    summary = summarize(rows)
    results = {
        **environment(started, load_at_start),
        "settings": {
            "check_steps": CHECK_STEPS,
            "accelerate_steps_per_call": STEPS_PER_CALL,
            "grow_start": GROW_START,
            "grow_attempts": GROW_ATTEMPTS,
            "classic_max_batch_size": CLASSIC_MAX,
        },
        "oom_wording": oom_wording(),
        "cases": [
            {"workload": c.label, "capacity": c.capacity, "true_edge_key": c.key, "true": edges[c.key]} for c in CASES
        ],
        "peers": PEERS,
        "summary": summary,
        "targets": targets(summary),
        "runs": rows,
        "benchmark_seconds": round(time.perf_counter() - bench_start, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    atomic_write_text(HERE / "results.json", json.dumps(results, indent=1) + "\n")
    atomic_write_text(HERE / "RESULTS.md", write_report(results))
    for target in results["targets"]:
        print(f"{'met' if target['met'] else 'MISSED':6} {target['target']}: {target['value']}")
    print(f"benchmark: {results['benchmark_seconds']} s (true edges cached in true_edges.json)")


if __name__ == "__main__":
    main()
