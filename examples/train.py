"""A training workload as a new user writes it: a small text classifier built from
``nn.TransformerEncoder``, trained with AdamW on ``(token ids, labels)`` batches.

    batchfit find examples/train.py:make_workload --device sim:64MiB
    batchfit find examples/train.py:make_workload --seq-len 128 --device sim:64MiB

``make_workload`` returns a ``batchfit.Workload``; options such as ``--seq-len`` reach it because it
takes them. In your project, build the real model and take ``sample_batch`` from your data loader.
"""

from __future__ import annotations

import torch
from torch import nn

import batchfit as bf


class TextClassifier(nn.Module):
    """Token embeddings, a transformer encoder, mean pooling and a linear head."""

    def __init__(self, vocab: int = 1000, dim: int = 64, heads: int = 4, layers: int = 2, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(dim=1))


def make_workload(seq_len: int = 64, sample_size: int = 8) -> bf.Workload:
    """The classifier, one ``(ids, labels)`` sample batch, cross-entropy and AdamW."""
    torch.manual_seed(0)
    model = TextClassifier()
    ids = torch.randint(0, 1000, (sample_size, seq_len))
    labels = torch.randint(0, 4, (sample_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    return bf.Workload(model, (ids, labels), nn.CrossEntropyLoss(), optimizer)
