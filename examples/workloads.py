"""Workloads named as ``module:function``: a BERT classifier built from a small ``transformers`` config.

    PYTHONPATH=. batchfit find examples.workloads:bert --quiet   # from the repository root
    batchfit find examples/workloads.py:bert --seq-len 64 --device sim:64MiB   # the file form: no PYTHONPATH

A mapping batch runs ``model(**batch)`` and trains on ``output.loss``, as Hugging Face models do.
Nothing is downloaded: the weights are random, the shapes are a real BERT's at a small size.
"""

from __future__ import annotations

import torch

import batchfit as bf


def bert(seq_len: int = 32, sample_size: int = 4, layers: int = 2) -> bf.Workload:
    """A ``BertForSequenceClassification`` (2 layers, width 64) with AdamW on tokenised text."""
    from transformers import BertConfig
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=max(seq_len, 512),
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (sample_size, seq_len)),
        "attention_mask": torch.ones(sample_size, seq_len, dtype=torch.long),
        "labels": torch.randint(0, 2, (sample_size,)),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    return bf.Workload(model, batch, optimizer=optimizer, name="bert")
