"""The reliability campaign: fault injection, bad inputs and endurance, in one run.

- Fault injection (``tests/support/reliability_campaign.py``): 510 seeded injections over 5 workloads x 6
  methods: an OOM (``torch.OutOfMemoryError`` or a CUDA OOM message), a ``RuntimeError``, a
  ``ValueError``, the user's own exception type or a ``KeyboardInterrupt`` raised at a chosen
  operator of a real trial (building the batch, forward, backward, optimizer step). Counted:
  state differences, leaked bytes, wrong edges in the next search, errors not propagated unchanged.
- Bad inputs (``tests/support/bad_inputs.py``): every entry of the table, library and CLI.
- Endurance (``tests/support/endurance.py``): 1000 consecutive searches in this process.

Writes ``benchmarks/RELIABILITY.md`` and ``benchmarks/reliability.json``; exits with 1 when a
target is missed (any state difference, leak, wrong edge, misbehaving bad input, memory growth).

    make reliability      # or: python benchmarks/reliability.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import batchfit as bf
from batchfit.files import atomic_write_text

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
from bad_inputs import TABLE  # noqa: E402
from bad_inputs import Checked  # noqa: E402
from bad_inputs import check  # noqa: E402
from bad_inputs import cli_invoker  # noqa: E402
from endurance import TRACE_EVERY  # noqa: E402
from endurance import run_endurance  # noqa: E402
from fault_injection import KINDS  # noqa: E402
from fault_injection import PHASES  # noqa: E402
from reliability_campaign import CAMPAIGN_CASES  # noqa: E402
from reliability_campaign import METHODS  # noqa: E402
from reliability_campaign import STRATA  # noqa: E402
from reliability_campaign import Campaign  # noqa: E402
from reliability_campaign import run_campaign  # noqa: E402

SEED = 0
INJECTIONS = 510  # 17 rounds of 5 workloads x 6 methods
ENDURANCE_SEARCHES, ENDURANCE_WARMUP = 1000, 100
RSS_BOUND_MIB = 8.0  # resident memory may grow at most this much after the warm-up
OBJECT_BOUND = 200  # gc-tracked Python objects may grow at most this much after the warm-up


def log(line: str) -> None:
    print(line, flush=True)


def run_faults(count: int) -> Campaign:
    done: list[Any] = []

    def progress(outcome: Any) -> None:
        done.append(outcome)
        bad = outcome.problems or outcome.state_differences or outcome.leaked_bytes or outcome.wrong_edge_after
        if bad or len(done) % 50 == 0:
            log(
                f"  {len(done)}/{count} {outcome.case}/{outcome.method} {outcome.kind} in {outcome.fired_phase}"
                f"{' PROBLEM' if bad else ''}"
            )

    return run_campaign(count, seed=SEED, progress=progress)


def run_bad_inputs() -> list[Checked]:
    invoke, checked = cli_invoker(), []
    with tempfile.TemporaryDirectory() as root:
        for case in TABLE:
            folder = Path(root) / case.id
            folder.mkdir()
            checked.append(check(case, folder, invoke))
    return checked


def fault_section(campaign: Campaign) -> list[str]:
    figures, done = campaign.figures(), campaign.outcomes
    lines = ["## Fault injection", ""]
    lines += [
        f"{figures['injections']} injections (seed {SEED}) over {len(campaign.edges)} workloads x {len(METHODS)} methods, "
        f"{campaign.seconds:.0f} s. Each workload is trained a little first (optimizer state, grads, BatchNorm statistics, "
        "a mixed train/eval model, advanced RNG streams), and its true edge is a linear scan in that state: "
        + ", ".join(f"{name} {edge}" for name, edge in campaign.edges.items())
        + ". A clean search of every method records every op of its real trials and the phase it belongs to "
        "(from hooks and the autograd engine, not from batchfit). Each injection raises its error at one of those ops, "
        f"before the op runs or just after it ({figures['raised_after_op']} after: the op's output is alive in the "
        "raising frame). Errors are raised in real trials only, never in the fake-tensor trace.",
        "",
        "| error kind | " + " | ".join(PHASES) + " | total |",
        "|---|" + "---|" * (len(PHASES) + 1),
    ]
    matrix = Counter((o.kind, o.fired_phase) for o in done)
    for kind in KINDS:
        cells = [str(matrix[(kind, phase)]) for phase in PHASES]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {figures['by_kind'].get(kind, 0)} |")
    lines += [
        "",
        "| method | injections | state differences | leaks | wrong edges after | search problems |",
        "|---|---|---|---|---|---|",
    ]
    for label, _strategy, _trace in METHODS:
        mine = [o for o in done if o.method == label]
        lines.append(
            f"| {label} | {len(mine)} | {sum(bool(o.state_differences) for o in mine)} | "
            f"{sum(o.leaked_bytes != 0 for o in mine)} | {sum(o.wrong_edge_after for o in mine)} | "
            f"{sum(bool(o.problems) for o in mine)} |"
        )
    lines += [
        "",
        "- `oom` is a `torch.OutOfMemoryError`, `oom-message` a `RuntimeError` with a CUDA OOM message: each must fail "
        "exactly the trial it struck, and every other trial of that search must fit exactly when the linear scan says so. "
        "`runtime` (a device-side assert), `value`, `user` (the user's own exception class) and `interrupt` "
        "(`KeyboardInterrupt`) must come out of the search as the very same object.",
        "- After each: the state is compared bitwise (parameters, buffers, grads, optimizer state and groups, which "
        "objects the model and optimizer hold, every module's train/eval flag, torch/Python/NumPy RNG states); the "
        "device's live bytes must equal the workload's baseline (after dropping the propagated error and collecting); "
        "the next search (`auto`, no trace) must find the true edge, exactly.",
        f"- Phases are drawn in turn from {', '.join(STRATA)}. batchfit's own `failed_phase` of each OOM trial, against the "
        f"independent label (building the batch counts as forward there): {figures['phase_disagreements']} disagreements.",
        f"- While the caller still holds a propagated error, its traceback keeps the failed trial's tensors alive "
        f"(at most {figures['max_held_by_error_bytes'] / 1024:.0f} KiB here), as any Python exception does; they are "
        "freed with the error.",
        f"- Clean runs (no fault) with problems: {figures['clean_run_problems']}.",
        "",
    ]
    return lines


def bad_input_section(checked: list[Checked]) -> list[str]:
    working = [c for c in checked if not c.case.known_issue]
    ok = [c for c in working if not c.problems]
    lines = [
        "## Bad inputs",
        "",
        f"{len(checked)} malformed inputs from `tests/support/bad_inputs.py` ({sum(c.case.surface == 'library' for c in checked)} "
        f"to the library, {sum(c.case.surface == 'CLI' for c in checked)} to the CLI through typer's `CliRunner`): "
        f"**{len(ok)} of {len(working)} behave**; {len(checked) - len(working)} are known issues, listed at the end. "
        "Library: a `ValueError` or `TypeError` whose one-line message names the fix. CLI: exit code 2, no traceback, "
        "one `error: ...` line on stderr. Each runs in an empty folder holding only its input files; afterwards the "
        "folder must hold the same files with the same bytes (no output, no temporary file, a previous results file "
        "left as it was). `usage` rows are click's own usage errors (wrong type or choice): exit code 2 and no traceback, "
        "but click frames the one-line reason in a usage box of five lines.",
        "",
        "| input | surface | category | result | what it said |",
        "|---|---|---|---|---|",
    ]
    for c in checked:
        result = ("known issue" if c.case.known_issue else "**FAILED**") if c.problems else "ok"
        if c.case.known_issue and not c.problems:
            result = "fixed: remove known_issue"
        said = c.seen.replace("|", "\\|")[:150]
        lines.append(
            f"| {c.case.id} | {c.case.surface}{' (usage)' if c.case.usage else ''} | {c.case.category} | "
            f"{result} | `{said}` |"
        )
    lines += ["", "Known issues (the table expects them to fail until fixed):", ""]
    lines += [f"- `{c.case.id}`: {c.case.known_issue}" for c in checked if c.case.known_issue]
    failed = [c for c in working if c.problems]
    if failed:
        lines += ["", "Failed:", ""] + [f"- `{c.case.id}`: {'; '.join(c.problems)}" for c in failed]
    return [*lines, ""]


def endurance_section(figures: dict[str, Any], methods: Counter) -> list[str]:
    objects = ", ".join(f"{count:,} after {index}" for index, count in figures["objects"])
    return [
        "## Endurance",
        "",
        f"{figures['searches']} consecutive searches in this process, {figures['seconds']:.0f} s "
        f"({figures['seconds_per_search'] * 1000:.0f} ms each), rotating over the {len(CAMPAIGN_CASES)} workloads and "
        f"the methods ({', '.join(f'{m} {n}' for m, n in methods.items())}; the traced `auto` two searches in {TRACE_EVERY + 1}: first, and mid-cycle). "
        "Each workload keeps one `SimulatedDevice` for the whole run, so anything a search leaves alive stays counted.",
        "",
        "| figure | value | bound |",
        "|---|---|---|",
        f"| searches that missed the edge | {figures['wrong_edges']} | 0 |",
        f"| device bytes above baseline after a search (max over all) | {figures['max_extra_live_bytes']} | 0 |",
        f"| RSS at the start | {figures['rss_start_mib']:.1f} MiB | |",
        f"| RSS after {ENDURANCE_WARMUP} searches (warm-up) | {figures['rss_after_warmup_mib']:.1f} MiB | |",
        f"| RSS at the end | {figures['rss_end_mib']:.1f} MiB | |",
        f"| RSS growth after the warm-up (highest minus warm-up) | {figures['rss_growth_after_warmup_mib']:.2f} MiB | "
        f"<= {RSS_BOUND_MIB:g} MiB |",
        f"| gc-tracked objects growth after the warm-up | {figures['object_growth_after_warmup']} | <= {OBJECT_BOUND} |",
        "",
        f"Objects tracked by Python's gc: {objects}. RSS is read from `/proc/self/statm`. The warm-up absorbs the "
        "allocator's pools and torch's lazily built caches; a leak of one batch per search would show in the device "
        "bytes at once, and a leaked `Trial` per search in the object count.",
        "",
    ]


def summary(campaign: Campaign, checked: list[Checked], endurance: dict[str, Any]) -> tuple[list[str], bool]:
    f = campaign.figures()
    working = [c for c in checked if not c.case.known_issue]
    bad_ok = sum(not c.problems for c in working)
    rows = [
        ("fault injections", f["injections"], ">= 500", f["injections"] >= 500),
        ("state differences after an injection", f["state_differences"], "0", f["state_differences"] == 0),
        ("leaks after an injection", f["leaks"], "0", f["leaks"] == 0),
        ("wrong edges in the next search", f["wrong_edges_after"], "0", f["wrong_edges_after"] == 0),
        (
            "errors not propagated unchanged / OOMs not a failed trial",
            f["search_problems"],
            "0",
            f["search_problems"] == 0,
        ),
        ("problems in clean searches", f["clean_run_problems"], "0", f["clean_run_problems"] == 0),
        (
            "bad inputs that behave",
            f"{bad_ok}/{len(working)} ({len(checked)} in the table)",
            "all, >= 25",
            bad_ok == len(working) >= 25,
        ),
        ("endurance searches", endurance["searches"], ">= 1000", endurance["searches"] >= ENDURANCE_SEARCHES),
        (
            "endurance: device bytes growth",
            endurance["max_extra_live_bytes"],
            "0",
            endurance["max_extra_live_bytes"] == 0,
        ),
        (
            "endurance: RSS growth after warm-up",
            f"{endurance['rss_growth_after_warmup_mib']:.2f} MiB",
            f"<= {RSS_BOUND_MIB:g} MiB",
            endurance["rss_growth_after_warmup_mib"] <= RSS_BOUND_MIB,
        ),
        ("endurance: wrong edges", endurance["wrong_edges"], "0", endurance["wrong_edges"] == 0),
    ]
    lines = ["## Summary", "", "| figure | value | target | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {value} | {target} | {'yes' if met else '**no**'} |" for name, value, target, met in rows]
    return [*lines, ""], all(met for *_rest, met in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 injections and 200 searches, no files written")
    options = parser.parse_args()
    injections, searches = (60, 200) if options.quick else (INJECTIONS, ENDURANCE_SEARCHES)
    torch.set_num_threads(1)  # tiny CPU models: more threads only contend, and a loaded machine makes it worse
    start = time.perf_counter()
    log(f"fault injection: {injections} injections ...")
    campaign = run_faults(injections)
    log(f"bad inputs: {len(TABLE)} entries ...")
    checked = run_bad_inputs()
    log(f"endurance: {searches} searches ...")
    run = run_endurance(searches, CAMPAIGN_CASES, warmup=ENDURANCE_WARMUP, seed=SEED)
    endurance = run.figures(ENDURANCE_WARMUP)
    seconds = time.perf_counter() - start
    table, met = summary(campaign, checked, endurance)
    header = [
        "# Reliability campaign",
        "",
        f"Generated by `make reliability` (`python benchmarks/reliability.py`) on {datetime.date.today().isoformat()}: "
        f"batchfit {bf.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} ({torch.get_num_threads()} torch thread of the machine's cores), on `SimulatedDevice` "
        f"(real CPU compute, every live tensor byte counted). {seconds / 60:.1f} minutes in all. `make test` runs a "
        "reduced form (`tests/project/test_reliability.py`). "
        "To keep the full collections that batchfit runs after a failed trial cheap, the fault campaign freezes the "
        "objects alive before it starts (`gc.freeze`); objects made later are collected as usual.",
        "",
    ]
    lines = header + table + fault_section(campaign) + bad_input_section(checked)
    lines += endurance_section(endurance, Counter(run.methods))
    log("\n".join(table))
    if options.quick:  # a try-out: the report keeps the full run's figures
        sys.exit(0 if met else 1)
    atomic_write_text(HERE / "RELIABILITY.md", "\n".join(lines))
    document = {
        "faults": campaign.figures(),
        "edges": campaign.edges,
        "clean_problems": campaign.clean_problems,
        "failures": [vars(o) for o in campaign.failures()],
        "bad_inputs": [
            {"id": c.case.id, "problems": c.problems, "said": c.seen, "known_issue": c.case.known_issue}
            for c in checked
        ],
        "endurance": {k: v for k, v in endurance.items()},
        "seconds": seconds,
        "targets_met": met,
    }
    atomic_write_text(HERE / "reliability.json", json.dumps(document, indent=1) + "\n")
    log(f"wrote benchmarks/RELIABILITY.md and benchmarks/reliability.json in {seconds:.0f} s")
    sys.exit(0 if met else 1)


if __name__ == "__main__":
    main()
