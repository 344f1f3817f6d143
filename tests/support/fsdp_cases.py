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
