"""Benchmark: does the answer hold in the loop people write, under the CUDA caching allocator model?

Random small models (MLPs with and without BatchNorm, CNNs, a transformer encoder, an LSTM; AdamW, Adam, SGD
with momentum) and capacities, on ``SimulatedDevice(capacity, allocator="cuda")`` and ``"cuda-expandable"``:
``find_max_batch_size``'s answer, then the hand-written loop of ``tests/support/user_loops.py`` on a fresh device
(the model copied on by ``Module._apply``, a new batch copied in every step) for 20 steps in each of four orders
(the last batch freed before or after the copy; ``zero_grad`` at the top of the step or at its end), at the answer
and one above. A case holds when every order runs 20 steps at the answer; it is exact when some order runs out of
memory one above (within the steps the trial said it would), conservative when none does.

``--before-src DIR`` also runs the campaign with another checkout's ``src`` (the answers before a change), in a
child process, for the before/after table. Writes benchmarks/USER-LOOPS.md.

    python benchmarks/loop_campaign.py --cases 64 [--before-src /tmp/before/src]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import torch  # noqa: E402

import batchfit as bf  # noqa: E402
from user_loops import KINDS  # noqa: E402
from user_loops import OPTIMIZERS  # noqa: E402
from user_loops import FiveLinears  # noqa: E402
from user_loops import RandomCase  # noqa: E402
from user_loops import first_failure  # noqa: E402
from user_loops import loop_failure  # noqa: E402
from user_loops import loss_fn  # noqa: E402
from user_loops import request_log  # noqa: E402

ALLOCATORS = ("cuda", "cuda-expandable")
LOOP_STEPS = 20
LOOKING_UP = 8  # sizes tried above a conservative answer for the loop's own edge
SIDE_BY_SIDE_ROWS = 242  # one step's trial answered 242 for FiveLinears; the loop fails there at step 2
SHOWN_REQUESTS = 44


def trial_requests(rows: int = SIDE_BY_SIDE_ROWS) -> tuple[list[str], str]:
    """What the modelled allocator sees of a two-step trial of ``FiveLinears`` at ``rows`` (parameters placed,
    then the trial), and the trial's verdict."""
    case = FiveLinears()
    model, sample, optimizer = case.build()
    device = bf.SimulatedDevice(case.capacity_bytes(), allocator="cuda")
    with request_log(device) as log:
        trial = bf.probe_batch_size(model, sample, rows, loss_fn=loss_fn, optimizer=optimizer, device=device)
    steps = getattr(trial, "loop_steps", None) or trial.steps + 1
    return log, "fits" if trial.fits else f"out of memory at step {steps}"


def loop_requests(rows: int = SIDE_BY_SIDE_ROWS) -> tuple[list[str], str]:
    """The same for 20 steps of the hand-written loop (parameters copied on by ``Module._apply``)."""
    case = FiveLinears()
    device = bf.SimulatedDevice(case.capacity_bytes(), allocator="cuda")
    with request_log(device) as log:
        failed = loop_failure(case, rows, "cuda", steps=20, device=device)
    return log, "held 20 steps" if failed is None else f"out of memory at step {failed}"


def draw_cases(count: int, seed: int = 2026) -> list[tuple[RandomCase, str]]:
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        case = RandomCase(
            kind=rng.choice(KINDS),
            width=rng.choice((32, 64, 96, 128)),
            depth=rng.randint(1, 4),
            optimizer=rng.choice(OPTIMIZERS),
            capacity_factor=rng.randint(3, 24),
            seed=rng.randint(0, 10_000),
        )
        cases.append((case, ALLOCATORS[index % 2]))
    return cases


def run_case(case: RandomCase, allocator: str) -> dict[str, Any]:
    model, sample, optimizer = case.build()
    device = bf.SimulatedDevice(case.capacity_bytes(), allocator=allocator)
    started = time.perf_counter()
    try:
        result = bf.find_max_batch_size(
            model, sample, loss_fn=loss_fn, optimizer=optimizer, device=device, trace=False, cache=False
        )
    except (bf.ModelDoesNotFitError, bf.NoBatchFitsError):
        return {"case": str(case), "allocator": allocator, "answer": None}
    seconds = time.perf_counter() - started
    answer = result.batch_size
    above = {t.batch_size: t for t in result.trials}.get(answer + 1)
    said_step = getattr(above, "loop_steps", None) if above is not None else None
    steps = max(LOOP_STEPS, said_step or 0)
    at_answer = first_failure(case, answer, allocator, LOOP_STEPS)
    one_above = first_failure(case, answer + 1, allocator, steps)
    row = {
        "case": str(case),
        "allocator": allocator,
        "answer": answer,
        "trials": len(result.trials),
        "seconds": seconds,
        "held": at_answer is None,
        "failed_at_step": None if at_answer is None else at_answer[0],
        "one_above_fails": one_above is not None,
        "one_above_step": None if one_above is None else one_above[0],
        "settled": [getattr(t, "settled", None) for t in result.trials if t.batch_size == answer][-1:],
        "loop_steps": [getattr(t, "loop_steps", None) for t in result.trials if t.batch_size == answer][-1:],
    }
    if at_answer is None and one_above is None:
        row["loop_edge"] = next(
            (size - 1 for size in range(answer + 2, answer + 2 + LOOKING_UP) if first_failure(case, size, allocator)),
            None,
        )
    return row


def campaign(count: int) -> list[dict[str, Any]]:
    rows = []
    for case, allocator in draw_cases(count):
        rows.append(run_case(case, allocator))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, int]:
    found = [r for r in rows if r["answer"] is not None]
    held = [r for r in found if r["held"]]
    return {
        "cases": len(rows),
        "answered": len(found),
        "held": len(held),
        "exact": sum(r["one_above_fails"] for r in held),
        "conservative": sum(not r["one_above_fails"] for r in held),
    }


def before(src: str, count: int) -> dict[str, Any]:
    """The same campaign and the trial's requests with ``src``'s batchfit, in a child process."""
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(
        [sys.executable, __file__, "--cases", str(count), "--rows-only"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def side_by_side(before_trial: tuple[list[str], str] | None) -> list[str]:
    """The first requests of the trial before, the trial now and the loop, for ``FiveLinears`` at 242 rows."""
    now, loop = trial_requests(), loop_requests()
    columns = [("the trial before", before_trial)] if before_trial is not None else []
    columns += [("the trial now", now), ("the hand-written loop", loop)]
    lines = [
        f'## The requests side by side: FiveLinears at {SIDE_BY_SIDE_ROWS} rows, `allocator="cuda"`',
        "",
        "Bytes asked of the caching allocator model (`+`) and blocks freed (`-`), in order, from the parameters'",
        "placement on. The trial before built its batch on the device from the sample's rows (index temporaries",
        "of 1,936 bytes made and freed first), once, and the allocator's cache was judged after its two steps; the",
        "loop copies a new batch in every step, while the last one still lives, and its cache carries on. The",
        "trial now copies its batch in as the loop does and runs the loop on in the allocator model.",
        "",
        "Where they part (11 and 13 below): the trial before asked for index temporaries and built its batch on the",
        "device, so its batch and activations landed elsewhere in the one 2 MiB segment. Past row 44, at step 2,",
        "the loop asks for a new batch (+61952, +1936) while the last one lives and frees the old one after it; the",
        "trial before asked for none, and judged the allocator after two steps: the loop's step 2 finds the cache",
        "as step 1 left it, with the new batch where a block of activations went before, and a 121 KiB request",
        "has no hole to go in (1.8 MiB allocated, 206.5 KiB cached in pieces, 1.1 MiB free but no room for a",
        "second 2 MiB segment). The fix, named against the sequences: the batch copied in every step as the loop",
        "copies it (rows 11-12 now match), and the loop run on in the allocator model from where the trial left it.",
        "",
        "| # | " + " | ".join(name for name, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    logs = [log for _, (log, _) in columns]
    for index in range(min(SHOWN_REQUESTS, max(len(log) for log in logs))):
        cells = [log[index] if index < len(log) else "" for log in logs]
        mark = " ←" if before_trial is not None and cells[0] != cells[-1] else ""
        lines.append(f"| {index + 1}{mark} | " + " | ".join(cells) + " |")
    lines.append("| outcome | " + " | ".join(verdict for _, (_, verdict) in columns) + " |")
    return lines


def report(
    after_rows: list[dict[str, Any]],
    before_rows: list[dict[str, Any]] | None,
    seconds: float,
    before_trial: tuple[list[str], str] | None,
) -> str:
    after = summary(after_rows)
    lines = [
        "# The answer in the loop people write, under the caching allocator model",
        "",
        f"Written by `python benchmarks/loop_campaign.py --cases {after['cases']}"
        + (" --before-src BEFORE/src`" if before_rows is not None else "`")
        + f" on {time.strftime('%Y-%m-%d')} in "
        f"{seconds:.0f} s, on a shared two-core {platform.machine()} machine with no GPU, torch {torch.__version__}.",
        "Random small models and capacities (`tests/support/user_loops.py`: MLPs with and without BatchNorm, CNNs,",
        'a transformer encoder, an LSTM; AdamW, Adam, SGD with momentum), half on `allocator="cuda"`, half on',
        '`"cuda-expandable"`. The check is the hand-written loop on a fresh device, 20 steps, in all four orders',
        "(the last batch freed before or after the new copy; `zero_grad` at the top of the step or at its end).",
        "BEFORE is a checkout of the commit before trials became the loop (70589df)." if before_rows else "",
        "",
        "| | cases | answered | held 20 steps at the answer | one above runs out of memory | one above holds (conservative) |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in (
        ("before (the trial's batch built once, one step's cache)", before_rows),
        ("after", after_rows),
    ):
        if rows is None:
            continue
        s = summary(rows)
        lines.append(f"| {label} | {s['cases']} | {s['answered']} | {s['held']} | {s['exact']} | {s['conservative']} |")
    missed = [r for r in (before_rows or []) if r["answer"] is not None and not r["held"]]
    if missed:
        steps = Counter(r["failed_at_step"] for r in missed)
        lines += ["", "Before, the loop ran out of memory at the answer at step " + _steps(steps) + "."]
    conservative = [r for r in after_rows if r["answer"] is not None and r["held"] and not r["one_above_fails"]]
    if conservative:
        lines += ["", "Conservative answers after (the loop's own edge, looked for up to 8 above):", ""]
        lines += [
            f"- {r['case']}, {r['allocator']}: answer {r['answer']}, loop edge {r['loop_edge']}" for r in conservative
        ]
    settled = Counter(str(r["settled"][0]) if r["settled"] else "n/a" for r in after_rows if r["answer"] is not None)
    loop_steps = sorted(r["loop_steps"][0] for r in after_rows if r.get("loop_steps") and r["loop_steps"][0])
    lines += [
        "",
        f"The allocator model's state repeated (the loop settled) at the answer in {settled.get('True', 0)} of "
        f"{after['answered']} cases within 64 steps after the trial's 2"
        + (
            f"; steps run at the answer: median {loop_steps[len(loop_steps) // 2]}, most {loop_steps[-1]}."
            if loop_steps
            else "."
        ),
        "",
        "| case | allocator | answer | trials | search s | held | one above fails (at step) | loop steps | settled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in after_rows:
        if r["answer"] is None:
            lines.append(f"| {r['case']} | {r['allocator']} | does not fit | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r['allocator']} | {r['answer']} | {r['trials']} | {r['seconds']:.1f} | "
            f"{'yes' if r['held'] else 'step ' + str(r['failed_at_step'])} | "
            f"{'yes (' + str(r['one_above_step']) + ')' if r['one_above_fails'] else 'no'} | "
            f"{(r['loop_steps'] or [None])[0]} | {(r['settled'] or [None])[0]} |"
        )
    return "\n".join([*lines, "", *side_by_side(before_trial)]) + "\n"


def _steps(counts: Counter) -> str:
    return ", ".join(f"{step} ({n})" for step, n in sorted(counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=64)
    parser.add_argument("--before-src")
    parser.add_argument("--rows-only", action="store_true")
    args = parser.parse_args()
    started = time.time()
    rows = campaign(args.cases)
    if args.rows_only:
        print(json.dumps({"rows": rows, "trial": trial_requests()}))
        return
    old = before(args.before_src, args.cases) if args.before_src else None
    before_rows, before_trial = (old["rows"], tuple(old["trial"])) if old is not None else (None, None)
    text = report(rows, before_rows, time.time() - started, before_trial)
    from batchfit.files import atomic_write_text

    atomic_write_text(HERE / "USER-LOOPS.md", text)
    print(text)


if __name__ == "__main__":
    main()
