"""A model-and-data function for the commands that take a workload: ``batchfit estimate``,
``optimal``, ``plan`` and ``critical``.

    batchfit estimate examples/my_model.py:make --capacity 24GiB
    batchfit critical examples/my_model.py:make --steps 50 --batch-size 64 --micro-batch-size 8

``make`` returns a ``batchfit.Workload``: the model, one real sample batch, the loss and the optimizer.
``batchfit critical`` draws its batches from the sample's rows and passes ``--population`` as
``sample_size``, so a function that takes ``sample_size`` decides how many rows there are.
"""

from __future__ import annotations

import torch
from torch import nn

import batchfit as bf


def make(features: int = 64, hidden: int = 256, classes: int = 10, sample_size: int = 64) -> bf.Workload:
    """An MLP classifier on ``(features, labels)`` with AdamW; the labels follow the features."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)
    )
    inputs = torch.randn(sample_size, features)
    labels = inputs[:, :classes].argmax(dim=1)  # a learnable rule, so the gradient noise means something
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return bf.Workload(model, (inputs, labels), nn.CrossEntropyLoss(), optimizer)
