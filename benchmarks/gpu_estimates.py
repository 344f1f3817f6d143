"""Benchmark: estimates for a GPU nobody here has, against what the GPU measured.

For each model, ``estimate_memory`` of a model that lives on the CPU, two ways: traced with the CPU's kernels (a
trace for a capacity in bytes, as every estimate ran before) and traced as the target GPU runs (a trace for its
preset: the attention kernel CUDA would choose, CUDA's autocast lists, fused dropout, foreach optimizers, cuBLAS's
workspaces and the attention backward's scratch; ``batchfit.devices.cuda_kernels``). The first three rows have
a real peak, measured on an NVIDIA H200 (torch 2.11 + CUDA 13, ``shared/notes/real-gpu.md``: ``probe_batch_size``
on the GPU, two steps, the output kept); the others have none yet, and say which kernels the trace chose and
what it could not count.

Needs torchvision and timm for their rows (without them the table is printed, not written): the figures in
benchmarks/GPU-ESTIMATES.md were written in a separate environment with torch 2.14.1, torchvision 0.29.1 and timm (this project's `src` on
PYTHONPATH), as benchmarks/regimes.py's vision rows are.

    python benchmarks/gpu_estimates.py
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.devices.presets import usable_bytes
from batchfit.devices.trace import TraceDevice
from batchfit.files import atomic_write_text

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests" / "support"))
from hf_models import Size  # noqa: E402

TARGET = "h200-141gb"


@dataclass(frozen=True)
class Row:
    name: str
    build: Callable[[], tuple[nn.Module, Any, Any, Any]]  # model, sample, loss_fn, optimizer
    batch_size: int
    real_bytes: int | None = None
    needs: str | None = None  # the package the model comes from


def _gpt2(attention: str = "sdpa") -> Callable[[], tuple]:
    def build() -> tuple:
        from transformers import GPT2Config
        from transformers import GPT2LMHeadModel

        size = Size(768, 12, 12, 3072, 50257, 1024)
        config = GPT2Config(n_positions=size.seq, bos_token_id=0, eos_token_id=0, attn_implementation=attention)
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, size.vocab, (2, size.seq))
        return model, {"input_ids": ids, "labels": ids}, None, torch.optim.AdamW(model.parameters(), lr=3e-4)

    return build


def _llama() -> tuple:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (2, 2048))
    return model, {"input_ids": ids, "labels": ids}, None, torch.optim.AdamW(model.parameters(), lr=3e-4)


def _bert() -> tuple:
    from transformers import BertConfig
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=3))
    ids = torch.randint(0, 30522, (2, 512))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1])}
    return model, batch, None, torch.optim.AdamW(model.parameters(), lr=3e-4)


def _vision(make: Callable[[], nn.Module], optimizer: str) -> Callable[[], tuple]:
    def build() -> tuple:
        torch.manual_seed(0)
        model = make()
        sample = (torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,)))
        if optimizer == "sgd":
            return model, sample, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, sample, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=3e-4)

    return build


def _torchvision(name: str) -> Callable[[], nn.Module]:
    return lambda: getattr(__import__("torchvision").models, name)()


def _timm(name: str) -> Callable[[], nn.Module]:
    return lambda: __import__("timm").create_model(name, pretrained=False)


class LstmModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.lstm, self.head = (
            nn.Embedding(32000, 1024),
            nn.LSTM(1024, 1024, 2, batch_first=True),
            nn.Linear(1024, 32000),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def _lstm() -> tuple:
    torch.manual_seed(0)
    model, ids = LstmModel(), torch.randint(0, 32000, (2, 256))
    loss = lambda out, targets: F.cross_entropy(out.flatten(0, 1), targets.flatten())  # noqa: E731
    return model, (ids, ids), loss, torch.optim.AdamW(model.parameters(), lr=3e-4)


ROWS = [
    Row("HF GPT-2 small (12 x 768, seq 1024), SDPA, AdamW", _gpt2(), 88, 140_528_346_112, "transformers"),
    Row("torchvision resnet50, SGD momentum, 224 px", _vision(_torchvision("resnet50"), "sgd"), 256, 11_805_301_248, "torchvision"),
    Row("timm vit_base_patch16_224, AdamW", _vision(_timm("vit_base_patch16_224"), "adamw"), 128, 10_225_302_528, "timm"),
    Row("HF GPT-2 small, eager attention, AdamW", _gpt2("eager"), 32, None, "transformers"),
    Row("HF Llama (8 x 1024, GQA 16/4, seq 2048), SDPA, AdamW", _llama, 16, None, "transformers"),
    Row("HF BERT-base (seq 512), SDPA, AdamW", _bert, 128, None, "transformers"),
    Row("timm convnext_tiny, AdamW, 224 px", _vision(_timm("convnext_tiny"), "adamw"), 256, None, "timm"),
    Row("torchvision mobilenet_v3_large, SGD momentum, 224 px", _vision(_torchvision("mobilenet_v3_large"), "sgd"), 512, None, "torchvision"),
    Row("nn.LSTM LM (2 x 1024, seq 256), AdamW", _lstm, 128, None, None),
]  # fmt: skip


def estimate(row: Row, device: TraceDevice) -> bf.MemoryEstimate:
    model, sample, loss_fn, optimizer = row.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bf.estimate_memory(
            model, sample, row.batch_size, loss_fn=loss_fn, optimizer=optimizer, amp_dtype="bf16", device=device
        )


def _kernels(row: Row) -> list[str]:
    """The attention kernels a trace for the target chose (one small fake step)."""
    model, sample, loss_fn, optimizer = row.build()
    tracer = TraceDevice(TARGET).unlimited()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf.probe_batch_size(model, sample, 2, loss_fn=loss_fn, optimizer=optimizer, amp_dtype="bf16", device=tracer)
    return sorted(set(tracer.attention_kernels))


def _error(estimate_bytes: int, real: int | None) -> str:
    return f"{(estimate_bytes - real) / real:+.2%}" if real else "no GPU figure yet"


def main() -> None:
    started = time.time()
    skipped = False
    lines = [
        "| model (bf16 autocast) | batch | real peak on the H200 (bytes) | CPU kernels (before) | error | as the GPU runs (now) | error | attention kernel | not counted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        if row.needs and importlib.util.find_spec(row.needs) is None:
            lines.append(f"| {row.name} | {row.batch_size} | | skipped: needs {row.needs} | | | | | |")
            skipped = True
            continue
        before = estimate(row, TraceDevice(usable_bytes(TARGET)))
        now = estimate(row, TraceDevice(TARGET))
        notes = [*now.not_counted, *(f"under-counted: {op}" for op in now.undercounted_ops)]
        real = f"{row.real_bytes:,}" if row.real_bytes else "-"
        lines.append(
            f"| {row.name} | {row.batch_size} | {real} | {before.peak_bytes:,} | {_error(before.peak_bytes, row.real_bytes)} "
            f"| {now.peak_bytes:,} | {_error(now.peak_bytes, row.real_bytes)} | {', '.join(_kernels(row)) or '-'} "
            f"| {'; '.join(notes) or '-'} |"
        )
        print(lines[-1], flush=True)
    versions = f"torch {torch.__version__}"
    for package in ("transformers", "torchvision", "timm"):
        if importlib.util.find_spec(package) is not None:
            versions += f", {package} {__import__(package).__version__}"
    text = f"""# Estimates for a GPU you don't have, against the GPU

Written by `python benchmarks/gpu_estimates.py` on {time.strftime("%Y-%m-%d")} ({time.time() - started:.0f} s) on a
shared two-core {platform.machine()} machine with no GPU, {versions}. Each estimate is `estimate_memory` of a
model living on the CPU for `{TARGET}`: "CPU kernels" is the trace as it ran before (the CPU's attention,
autocast lists, dropout and optimizer loop); "as the GPU runs" is the trace for the preset now. The real peaks
were measured on an NVIDIA H200 (torch 2.11 + CUDA 13; `shared/notes/real-gpu.md`); no GPU was at hand for the
rows without one, so nothing says yet how close they are.

{chr(10).join(lines)}

What was left, row by row:
- GPT-2 small: the CPU runs attention with dropout on the math path and keeps three fp32 score matrices a layer;
  CUDA's flash kernel keeps none (cuDNN's is not taken: dropout 0.1 is not in sixteenths). CUDA's autocast
  runs `gelu_new`'s `pow` and the layer norms in fp32, which the CPU keeps in bf16.
- resnet50: cuDNN's convolution workspaces are not counted (only the card's cuDNN sizes them); the residue is
  within that.
- ViT-B/16: 1.6% under, the open residue. Attention takes flash here; on the H200 cuDNN's attention (preferred
  past cuDNN 9.15 on Hopper) may have run, with its own workspace; the patch embedding's convolution workspace
  is not counted either. Until a GPU says which, this row is the one short of the goal (within 1% under).
- The LSTM: a CUDA LSTM keeps cuDNN's reserve space, which only the card sizes: the estimate names
  `aten::mkldnn_rnn_layer` as under-counted and gives no "fits" verdict.
"""
    print(text)
    if skipped:  # the kept file has every row: a partial run does not replace it
        print("benchmarks/GPU-ESTIMATES.md not written: some rows need torchvision and timm (see the module docstring)")
        return
    atomic_write_text(HERE / "GPU-ESTIMATES.md", text)


if __name__ == "__main__":
    main()
