"""One rank traced on the CPU mesh, then on the fake accelerator CPU offload runs on, without
offload: the same figures? Prints a JSON list of cases, each with one side's peak, breakdown and
phase peaks. AdamW keeps each parameter's ``step`` counter on the host where the parameter is on
an accelerator (as on a GPU), so the accelerator's side counts the host's optimizer state with the
device's. Each side runs in a process of its own: registering the accelerator cannot be undone.

    python tests/launch/offload_fidelity.py cpu
    python tests/launch/offload_fidelity.py accelerator
"""

from __future__ import annotations

import json
import sys

import torch

from batchfit.parallel import Parallelism
from batchfit.parallel import TinyTransformer
from batchfit.parallel import accelerator
from batchfit.parallel import trace_rank

GQA_LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
CASES = [
    ("TinyTransformer, 2 ranks, fp32", TinyTransformer, Parallelism(world_size=2)),
    (
        "TinyTransformer, 4 ranks, bf16, full",
        TinyTransformer,
        Parallelism(world_size=4, activation_checkpointing="full", **BF16),
    ),
    ("Llama (GQA), 2 ranks, fp32", GQA_LLAMA, Parallelism(world_size=2)),
    ("Llama (GQA), 4 ranks, bf16, full", GQA_LLAMA, Parallelism(world_size=4, activation_checkpointing="full", **BF16)),
]


def figures(estimate, host_state: int = 0) -> dict:
    """Peak, breakdown and phase peaks, with ``host_state`` optimizer bytes counted on the device."""
    breakdown = {**estimate.breakdown, "optimizer_state": estimate.breakdown["optimizer_state"] + host_state}
    phases = {phase: nbytes + host_state for phase, nbytes in estimate.phase_peaks_bytes.items()}
    return {"peak_bytes": estimate.peak_bytes + host_state, "breakdown": breakdown, "phase_peaks_bytes": phases}


def main(side: str) -> None:
    """Print this side's figures: ``cpu``, or ``accelerator`` (registered first: autograd sizes its
    per-device queues at the process's first backward)."""
    if side == "accelerator":
        accelerator.register()
    rows = []
    for name, model, parallelism in CASES:
        estimate = trace_rank(model, 2, 32, parallelism=parallelism)
        steps = estimate.host_breakdown.get("optimizer_state", 0)  # none on the CPU mesh
        rows.append({"case": name, "figures": figures(estimate, steps), "steps_bytes": steps})
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1])
