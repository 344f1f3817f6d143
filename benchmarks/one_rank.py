"""One rank's real trials at world size N against the fake-tensor estimate, for a ~110M-parameter
Llama built from its config: the rank's real peak (``probe_rank_batch_size`` on a ``SimulatedDevice``:
FSDP2 over torch's fake process group, only the rank's shards allocated), the fake trace's peak
(``trace_rank``), their difference, the wall time of each and the process's peak host memory.

Usage (from the repository root; a few minutes on two cores)::

    .venv/bin/python benchmarks/one_rank.py            # every world size, then the report
    .venv/bin/python benchmarks/one_rank.py --report   # ONE-RANK.md from one_rank.json

Each world size runs in its own process (``--case N``), so its peak resident memory is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "one_rank.json"
REPORT = ROOT / "benchmarks" / "ONE-RANK.md"
WORLD_SIZES = (8, 64, 512)
BATCH_SIZE, SEQ_LEN = 2, 256
CONFIG = {  # a Llama of ~110M parameters (GPT-2 small's width and depth, Llama's blocks)
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 16000,
    "max_position_embeddings": 1024,
}
DEVICE = "sim:4GiB"


def run_case(world_size: int) -> dict:
    """Both figures at one world size, in this process."""
    warnings.simplefilter("ignore")
    from batchfit.parallel import Parallelism
    from batchfit.parallel import probe_rank_batch_size
    from batchfit.parallel import trace_rank

    parallelism = Parallelism(world_size=world_size, param_dtype="bf16", reduce_dtype="fp32")
    start = time.perf_counter()
    trial = probe_rank_batch_size(CONFIG, SEQ_LEN, BATCH_SIZE, parallelism=parallelism, device=DEVICE)
    real_seconds = time.perf_counter() - start
    start = time.perf_counter()
    fake = trace_rank(CONFIG, BATCH_SIZE, SEQ_LEN, parallelism=parallelism)
    fake_seconds = time.perf_counter() - start
    return {
        "world_size": world_size,
        "real_peak_bytes": trial.peak_bytes,
        "fake_peak_bytes": fake.peak_bytes,
        "real_seconds": real_seconds,
        "fake_seconds": fake_seconds,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_average": os.getloadavg()[0],
    }


def report(results: list[dict]) -> str:
    mib = 2**20
    lines = [
        "# One rank, real, at world size N: against the fake-tensor estimate",
        "",
        f"A Llama of {parameter_count() / 1e6:.0f}M parameters built from its config (`benchmarks/one_rank.py`), FSDP2 "
        f"full shard with bf16 parameters and fp32 reduction, micro-batch {BATCH_SIZE} x {SEQ_LEN} tokens, AdamW. "
        f"**Real**: `probe_rank_batch_size` on `{DEVICE}` (rank 0's real training steps over torch's fake process "
        "group, only its shards allocated). **Fake**: `trace_rank` (the same rank on fake tensors). "
        "Both batches carry their labels as a tensor of their own, as a data collator makes them. Host memory is the process's "
        "peak resident set (both runs). Regenerate: `.venv/bin/python benchmarks/one_rank.py`.",
        "",
        "| ranks | real peak | fake estimate | difference | real trial (s) | fake trace (s) | host memory | load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        diff = r["real_peak_bytes"] - r["fake_peak_bytes"]
        lines.append(
            f"| {r['world_size']} | {r['real_peak_bytes'] / mib:.1f} MiB | {r['fake_peak_bytes'] / mib:.1f} MiB | "
            f"{diff:+,d} B ({diff / r['fake_peak_bytes']:+.3%}) | {r['real_seconds']:.1f} | {r['fake_seconds']:.1f} | "
            f"{r['max_rss_bytes'] / mib:.0f} MiB | {r['load_average']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parameter_count() -> int:
    import torch

    from batchfit.parallel.models import model_builder

    with torch.device("meta"):
        return sum(p.numel() for p in model_builder(CONFIG)().parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", type=int, help="run one world size in this process and print its JSON")
    parser.add_argument("--report", action="store_true", help="write ONE-RANK.md from one_rank.json")
    args = parser.parse_args()
    if args.case is not None:
        print(json.dumps(run_case(args.case)))
        return
    if not args.report:
        results = []
        for world_size in WORLD_SIZES:
            command = [sys.executable, __file__, "--case", str(world_size)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(output.strip().splitlines()[-1]))
            print(results[-1], flush=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    REPORT.write_text(report(json.loads(RESULTS.read_text())))
    print(f"wrote {REPORT}")


if __name__ == "__main__":
    main()
