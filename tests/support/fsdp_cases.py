"""The small training cases real FSDP2 (fsdp_agreement.py under torchrun) and the fake trace
(test_parallel_agreement.py) both run: a plain-torch transformer in fp32, and a small Llama from
its config under FSDP2's mixed precision (bf16 parameters, fp32 reduction), with and without
activation checkpointing."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.parallel.models import TinyTransformer
from batchfit.parallel.settings import Parallelism

TINY = functools.partial(TinyTransformer, vocab_size=256, hidden_size=64, num_heads=4, num_layers=2)
SMALL_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


@dataclass(frozen=True)
class Case:
    """What one case trains: the model (a factory, or a preset with config overrides), the batch,
    the steps, and the parallelism options apart from the world."""

    model: Any
    vocab_size: int
    batch_size: int = 4
    seq_len: int = 32
    steps: int = 4  # real runs: the first step and three later ones
    options: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)

    def parallelism(self, world_size: int, rank: int = 0) -> Parallelism:
        return Parallelism(world_size=world_size, rank=rank, **self.options)

    def spec(self) -> Any:
        """The model as ``trace_rank`` takes it."""
        if not self.overrides:
            return self.model
        from batchfit.parallel.models import model_config

        return model_config(self.model, **self.overrides)

    def largest_block_bytes(self) -> int:
        """Bytes of the largest repeated block's parameters in fp32: the most a real backend's late
        release of one block's reduce-scatter buffer can add to a step's peak."""
        from batchfit.parallel.wrap import repeated_blocks

        model = self.builder()()
        return max(sum(p.numel() for p in block.parameters()) for _, _, block in repeated_blocks(model)) * 4

    def builder(self):
        from batchfit.parallel.models import model_builder

        return model_builder(self.spec())


MIXED = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
CASES = {
    "tiny": Case(TINY, 256),
    "llama": Case("llama-3-8b", 512, 2, 64, options=MIXED, overrides=SMALL_LLAMA),
    "llama_checkpointed": Case(
        "llama-3-8b", 512, 2, 64, options={**MIXED, "activation_checkpointing": "full"}, overrides=SMALL_LLAMA
    ),
}


# -- a workload of one's own: a regression on a residual MLP stack ----------------------------------
# Real FSDP2 on two gloo ranks (fsdp_own_workload.py, measured by torch's FSDPMemTracker) and one
# rank's estimate of the user's Workload (estimate_own_rank on a TraceDevice, or its real trials)
# train the same thing: rows of SEQ_LEN x WIDTH features and a target of the same shape, each
# block fully_shard'ed and then the root, AdamW, F.mse_loss, the output and loss held through
# backward into the next step (the loop a user writes).
OWN_WIDTH, OWN_HIDDEN, OWN_BLOCKS, OWN_SEQ_LEN = 128, 512, 4, 64
OWN_BATCH_SIZES = (8, 32)


def residual_mlp() -> Any:
    """A stack of residual MLP blocks (norm, up, ReLU, down, plus the input) and a linear head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(OWN_WIDTH)
            self.up = nn.Linear(OWN_WIDTH, OWN_HIDDEN)
            self.down = nn.Linear(OWN_HIDDEN, OWN_WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(OWN_BLOCKS))
            self.head = nn.Linear(OWN_WIDTH, OWN_WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Stack()


def residual_mlp_rows(batch_size: int) -> tuple[Any, Any]:
    """``(inputs, targets)`` of ``batch_size`` rows (seeded)."""
    import torch

    generator = torch.Generator().manual_seed(batch_size)
    shape = (batch_size, OWN_SEQ_LEN, OWN_WIDTH)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def residual_mlp_optimizer(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def mse(output: Any, target: Any) -> Any:
    """The workload's loss (a ``loss_fn`` of an ``(inputs, targets)`` batch): ``F.mse_loss``."""
    import torch.nn.functional as F

    return F.mse_loss(output, target)


def residual_mlp_workload() -> Any:
    """The user's ``Workload`` of the residual MLP (a sample of 2 rows; the output kept through backward)."""
    import torch

    import batchfit as bf

    torch.manual_seed(0)
    model = residual_mlp()
    return bf.Workload(
        model, residual_mlp_rows(2), loss_fn=mse, optimizer=residual_mlp_optimizer(model.parameters()), name="own_mlp"
    )
