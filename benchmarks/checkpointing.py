"""Micro-batch x activation checkpointing on models nobody here wrote: each policy's largest micro-batch and
throughput on a simulated device, and the choice for two global batches.

The models: transformers' GPT-2 and Llama and a ViT, each from a small config (nothing is downloaded), and a
model of one's own built on ``nn.TransformerEncoder``. Each runs on a ``SimulatedDevice`` sized from the
trace to hold the training state and about five samples' activations without checkpointing (its real steps
fit two or three), so that checkpointing buys a larger micro-batch. The first global batch (the largest power
of two that fits in one step without checkpointing) needs no accumulation, so checkpointing only costs; the
second (96) needs many accumulation steps without it.

Timings are CPU timings of the simulated device (its memory accounting runs on every op): they compare the
rows of one table, not a GPU. Run: ``.venv/bin/python benchmarks/checkpointing.py`` (writes
``benchmarks/CHECKPOINTING.md`` and ``benchmarks/checkpointing-gpt2.png``).
"""

from __future__ import annotations

import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import batchfit as bf
from batchfit.throughput import CheckpointingFrontier
from batchfit.throughput.side_by_side import side_by_side

HERE = Path(__file__).parent
LARGE_BATCH = 96  # a global batch that needs accumulation without checkpointing; the small one is per model
SEQ_LEN, VOCAB = 64, 512


class OwnTransformer(nn.Module):
    """A user's own model: embeddings, ``nn.TransformerEncoder`` and a head."""

    def __init__(self, vocab: int = VOCAB, width: int = 128, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def _language(model: nn.Module, name: str) -> bf.Workload:
    ids = torch.randint(0, VOCAB, (4, SEQ_LEN))
    return bf.Workload(model, {"input_ids": ids, "labels": ids}, optimizer=torch.optim.AdamW, name=name)


def gpt2() -> bf.Workload:
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ_LEN)
    return _language(GPT2LMHeadModel(config), "GPT-2 (transformers, 4 x 128)")


def llama() -> bf.Workload:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ_LEN,
    )  # fmt: skip
    return _language(LlamaForCausalLM(config), "Llama (transformers, 4 x 128)")


def vit() -> bf.Workload:
    from transformers import ViTConfig
    from transformers import ViTForImageClassification

    config = ViTConfig(
        image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=512, num_labels=10,
    )  # fmt: skip
    batch = {"pixel_values": torch.randn(4, 3, 64, 64), "labels": torch.randint(0, 10, (4,))}
    return bf.Workload(ViTForImageClassification(config), batch, optimizer=torch.optim.AdamW, name="ViT (transformers)")


def own() -> bf.Workload:
    tokens = torch.randint(0, VOCAB, (4, SEQ_LEN))

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    model = OwnTransformer()
    return bf.Workload(model, (tokens, tokens), loss_fn=loss, optimizer=torch.optim.AdamW, name="own nn.Transformer")


MODELS = {"gpt2": (gpt2, "none,selective,full,hf"), "llama": (llama, "none,selective,full"),
          "vit": (vit, "none,selective,full"), "own": (own, "none,full:2,full")}  # fmt: skip


def capacity_for(work: bf.Workload) -> int:
    """The training state plus 5.5 samples' activations (from the trace at 1 and 2), in bytes."""
    one, two = (
        bf.estimate_memory(work.model, work.sample_batch, b, loss_fn=work.loss_fn, optimizer=work.optimizer)
        for b in (1, 2)
    )
    return int(one.peak_bytes + 2.5 * (two.peak_bytes - one.peak_bytes))


def measure(key: str) -> tuple[str, int, CheckpointingFrontier, CheckpointingFrontier, float]:
    build, policies = MODELS[key]
    torch.manual_seed(0)
    work = build()
    capacity = capacity_for(work)
    started = time.perf_counter()
    device = bf.SimulatedDevice(capacity)
    found = bf.throughput.frontier_for_workload(
        work,
        policies,
        device=device,
        global_batch_size=LARGE_BATCH,
        timing_warmup_steps=2,
        timed_steps=7,
        refine_rounds=1,
        on_policy=lambda p: print(f"  {key} {p.policy}: largest {p.largest_batch_size}", flush=True),
    )
    small = side_by_side(work, found.for_global_batch(small_batch(found)), device)
    return work.name, capacity, small, found, time.perf_counter() - started


def _rate(value: float | None) -> str:
    return f"{value:,.1f}" if value is not None else "-"


def small_batch(found: CheckpointingFrontier) -> int:
    """A global batch that fits in one step without checkpointing: the largest power of two that does (timed)."""
    plain = next(p for p in found.policies if p.policy == "none")
    return 1 << (plain.largest_batch_size.bit_length() - 1)


def table(small: CheckpointingFrontier, large: CheckpointingFrontier) -> list[str]:
    small_size, found = small.global_batch_size, large
    by_policy = [{c.policy: c for c in f.candidates} for f in (small, large)]
    lines = [
        f"| policy | largest micro-batch | as a later micro-batch | peak at largest | best samples/s (at) "
        f"| global {small_size} | global {LARGE_BATCH} |",
        "|---|--:|--:|--:|--:|---|---|",
    ]
    for policy in found.policies:
        throughput = policy.throughput
        best = throughput.point(throughput.best_batch_size) if throughput else None
        cells = []
        for choices, frontier in zip(by_policy, (small, large), strict=True):
            candidate = choices.get(policy.policy)
            text = f"{candidate.split} ({_rate(candidate.samples_per_second)}/s)" if candidate else "does not fit"
            cells.append(f"**{text}**" if candidate == frontier.choice else text)
        lines.append(
            f"| {policy.policy} | {policy.largest_batch_size} | {policy.accumulating_batch_size or '-'} "
            f"| {bf.format_bytes(policy.largest_peak_bytes) if policy.largest_peak_bytes else '-'} "
            f"| {_rate(best.samples_per_second if best else None)} ({best.batch_size if best else '-'}) "
            f"| {cells[0]} | {cells[1]} |"
        )
    lines += [
        "",
        f"- global batch {small_size}: {small.summary()}",
        f"- global batch {LARGE_BATCH}: {large.summary()}",
    ]
    return lines


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # a second thread only contends on a shared machine
    keys = sys.argv[1:] or list(MODELS)
    out = [
        "# Micro-batch x activation checkpointing",
        "",
        f"Generated by `.venv/bin/python benchmarks/checkpointing.py` on {platform.machine()} CPU, torch "
        f"{torch.__version__}, {time.strftime('%Y-%m-%d')}. Each model runs on a `SimulatedDevice` holding its "
        "training state (AdamW) and activations for about five samples without checkpointing as the trace counts them "
        "(the simulated device's real steps fit two or three: the first column). Timings are CPU "
        "timings of the simulated device, whose memory accounting runs on every op: they compare the rows of "
        "one table, not a GPU. Bold: the choice for that global batch (the most samples/s, the policy "
        "recomputing least within 5% of the fastest), from each policy's best split timed again beside the "
        "others' in turns (5 rounds of 3 steps: those are the samples/s in the last two columns); a cell is "
        "micro-batch x accumulation steps (samples/s). A window of accumulation steps is charged one optimizer "
        "step: its micro-batches' full steps less the optimizer steps all but the last skip, each timed on its own.",
        "",
    ]
    for key in keys:
        name, capacity, small, found, seconds = measure(key)
        out += [
            f"## {name}",
            "",
            f"Device: {found.device} ({bf.format_bytes(capacity)}); measured in {seconds:.0f} s.",
            "",
        ]
        out += [*table(small, found), ""]
        if key == "gpt2":
            from batchfit.cli.plots import plot_frontier

            plot_frontier(found, HERE / "checkpointing-gpt2.png")
            out += [
                "The plot of GPT-2's frontier (memory against samples/s per policy) is written beside this file as "
                "`checkpointing-gpt2.png` (not kept in the repository: PNGs are ignored).",
                "",
            ]
        print("\n".join(out[-12:]), flush=True)
    (HERE / "CHECKPOINTING.md").write_text("\n".join(out))


if __name__ == "__main__":
    main()
