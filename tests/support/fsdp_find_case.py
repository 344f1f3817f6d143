"""The model, sequence length and capacities of the search under real FSDP2 (``tests/launch/fsdp_find.py``
under torchrun), which its test (``tests/parallel/test_fsdp_find.py``) also traces on fake tensors."""

from __future__ import annotations

import torch

from batchfit.parallel.models import TinyTransformer

SEQ_LEN = 32
VOCAB_SIZE = 256
CAPACITY_BYTES = 3_500_000  # rank 1's device: about 5 sequences of SEQ_LEN tokens per rank
ROOMY_BYTES = 4 * CAPACITY_BYTES  # rank 0's device
MAX_BATCH_SIZE = 64


def build() -> torch.nn.Module:
    """The model both ranks and the fake trace train (the trace builds it from this function)."""
    return TinyTransformer(vocab_size=VOCAB_SIZE)
