"""The soak against the run written by hand: per model, the token budget from an emptied cache, the budget that
holds for a run of lengths drawn from a skewed distribution (most short, a long tail) with an evaluation pass
between, the same with expandable segments, the peak reserved and the retries over the run; then the run written by
hand (tests/support/soak_loops.py) on a fresh ``SimulatedDevice(capacity, allocator="cuda")`` at the soaked budget
and, where it is smaller, at the fresh one. Writes benchmarks/SOAK.md.

    .venv/bin/python benchmarks/soak.py --steps 1000 --eval-every 100
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))

import batchfit as bf  # noqa: E402
import hf_models  # noqa: E402
from batchfit.search.soak import SoakSettings  # noqa: E402
from batchfit.step.builtin_workloads import gpt_tiny  # noqa: E402
from batchfit.step.builtin_workloads import next_token_loss  # noqa: E402
from batchfit.tokens.budget import token_budget_of_workload  # noqa: E402
from batchfit.tokens.length_data import LengthSample  # noqa: E402
from batchfit.tokens.soak import soak_token_budget  # noqa: E402
from batchfit.tokens.soak import token_plan  # noqa: E402
from soak_loops import hand_run  # noqa: E402
from soak_loops import token_batch  # noqa: E402

MIB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], bf.Workload]
    buckets: tuple[int, ...]
    capacity_mib: float
    vocab: int
    mapping: bool  # a Hugging Face model: {"input_ids", "labels"}, its own loss


def _hf(build, size: hf_models.Size, name: str) -> Callable[[], bf.Workload]:
    return lambda: hf_models.workload(build, size, name)


CASES = [
    Case("gpt-tiny (batchfit's own, 1 layer)", lambda: gpt_tiny(seq_len=32, layers=1), (8, 16, 32), 10, 512, False),
    Case(
        "GPT-2 (transformers, 2 x 64)",
        _hf(hf_models.gpt2, hf_models.Size(64, 2, 2, 256, 256, 32), "gpt2"),
        (8, 16, 32),
        12,
        256,
        True,
    ),
    Case(
        "Llama (transformers, 2 x 64, GQA)",
        _hf(hf_models.llama, hf_models.Size(64, 2, 4, 128, 256, 32, kv_heads=2), "llama"),
        (8, 16, 32),
        12,
        256,
        True,
    ),
]


def skewed_lengths(longest: int) -> list[int]:
    """Most short, a long tail: a log-normal cut to ``longest``."""
    return np.clip(np.random.default_rng(1).lognormal(2.2, 0.6, 2000).astype(int), 2, longest).tolist()


def measure(case: Case, settings: SoakSettings) -> dict:
    capacity = int(case.capacity_mib * MIB)
    device = bf.SimulatedDevice(capacity, allocator="cuda")
    lengths = skewed_lengths(max(case.buckets))
    work = case.build()
    started = time.perf_counter()
    budget = token_budget_of_workload(work, list(case.buckets), device=device, packed=False, accumulating=False)
    search_seconds = time.perf_counter() - started
    started = time.perf_counter()
    run = soak_token_budget(work, budget, lengths, settings, device=device)
    soak_seconds = time.perf_counter() - started
    soaked = run.soaked
    row = {"case": case.name, "capacity_mib": case.capacity_mib, "search_s": search_seconds, "soak_s": soak_seconds}
    row.update(fresh=soaked.fresh, soaked=soaked.budget, expandable=soaked.expandable_budget)
    row.update(predicted=soaked.fresh_run.failed_step, binding=run.binding())
    held = soaked.held
    row.update(peak_mib=held.peak_reserved_bytes / MIB, retry_steps=held.steps_with_retries, most=max(held.retries))
    sample = LengthSample.of(lengths)
    for label, tokens in (("at_soaked", soaked.budget), ("at_fresh", soaked.fresh)):
        if label == "at_fresh" and tokens == soaked.budget:
            row[label], row[label + "_s"] = "same budget", 0.0
            continue
        plan = token_plan(tokens, run.buckets, sample, settings)
        fresh = case.build()
        started = time.perf_counter()
        failed = hand_run(
            fresh.model,
            fresh.optimizer,
            None if case.mapping else next_token_loss,
            token_batch(case.vocab, mapping=case.mapping),
            [key[1:] for key in plan.train],
            capacity,
            eval_every=settings.eval_every_steps,
            evals=[key[1:] for key in plan.eval_shapes],
        )
        row[label] = "all steps ran" if failed is None else f"out of memory at step {failed}"
        row[label + "_s"] = time.perf_counter() - started
    print(row, flush=True)
    return row


def table(rows: list[dict], settings: SoakSettings) -> str:
    head = (
        "| model | capacity | fresh-cache tokens | soaked tokens | with expandable segments | peak reserved at the "
        "soaked budget | steps with retries (most in one) | soak predicted OOM at fresh | hand-written run at soaked "
        "| hand-written run at fresh | search s | soak s | hand-written run s (soaked / fresh) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['capacity_mib']:g} MiB | {r['fresh']} | {r['soaked']} | {r['expandable']} | "
            f"{r['peak_mib']:.1f} MiB | {r['retry_steps']} ({r['most']}) | "
            f"{'-' if r['predicted'] is None else 'step ' + str(r['predicted'])} | {r['at_soaked']} | {r['at_fresh']} | "
            f"{r['search_s']:.1f} | {r['soak_s']:.1f} | {r['at_soaked_s']:.1f} / {r['at_fresh_s']:.1f} |"
        )
    binding = "\n".join(f"- {r['case']}: {r['binding']}." for r in rows)
    return (
        f"# Soak: the budget that holds for the run\n\n{settings.steps} training steps of lengths drawn (seed "
        f"{settings.seed}) from a log-normal cut to the longest bucket (most short, a long tail), an evaluation pass "
        f"of {settings.eval_steps} micro-batches every {settings.eval_every_steps} steps; buckets 8, 16, 32; each "
        "micro-batch tokens // bucket sequences padded to its bucket. Simulated devices on the CPU "
        "(SimulatedDevice(capacity, allocator='cuda')), torch "
        f"{torch.__version__}.\n\nGenerated by `.venv/bin/python benchmarks/soak.py --steps {settings.steps} "
        f"--eval-every {settings.eval_every_steps}`.\n\n{chr(10).join(lines)}\n\nWhich composition binds:\n\n{binding}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--only", help="run only the cases whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = SoakSettings(args.steps, args.eval_every)
    rows = [measure(case, settings) for case in CASES if not args.only or args.only in case.name]
    (HERE / "SOAK.md").write_text(table(rows, settings))
    print(f"Wrote {HERE / 'SOAK.md'}")


if __name__ == "__main__":
    main()
