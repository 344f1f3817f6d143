"""An experiment with knobs, for ``batchfit sweep``: each image comes as up to ``max_crops`` crops, and a
small mixture-of-experts layer sends each crop to its ``top_k`` experts. Both knobs change the memory a
step needs, so each configuration has its own largest batch.

    batchfit sweep examples/my_exp.py:make --grid max_crops=2,4,12 --rules examples/rules.json \
        --measure examples/my_exp.py:accuracy

``make(**knobs)`` builds one configuration's ``batchfit.Workload``; ``accuracy(knobs, batch_size,
workload)`` runs after each search with the batch found, and the dict it returns joins that
configuration's record in the results file.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import batchfit as bf


class TopKExperts(nn.Module):
    """Each row goes through its ``top_k`` highest-scoring experts, weighted by the router's softmax."""

    def __init__(self, dim: int, experts: int = 4, top_k: int = 1):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, experts)
        self.weights = nn.Parameter(torch.randn(experts, dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, chosen = self.router(x).softmax(dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for k in range(self.top_k):
            expert_weights = self.weights[chosen[:, k]]  # one (dim, dim) matrix per row
            out = out + scores[:, k, None] * torch.einsum("nd,nde->ne", x, expert_weights)
        return out


class CropClassifier(nn.Module):
    """Encodes every crop with a small CNN, mixes it through the experts, averages the crops."""

    def __init__(self, dim: int = 32, top_k: int = 1, classes: int = 10):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, dim, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.experts = TopKExperts(dim, top_k=top_k)
        self.head = nn.Linear(dim, classes)

    def forward(self, crops: torch.Tensor) -> torch.Tensor:
        batch, max_crops = crops.shape[:2]
        features = self.encoder(crops.flatten(0, 1))
        features = features + self.experts(features)
        return self.head(features.view(batch, max_crops, -1).mean(dim=1))


def make(max_crops: int = 2, top_k: int = 1, crop_size: int = 16, sample_size: int = 4) -> bf.Workload:
    """One configuration: ``(crops, labels)`` batches of ``max_crops`` crops per image, AdamW."""
    torch.manual_seed(0)
    model = CropClassifier(top_k=top_k)
    crops = torch.randn(sample_size, max_crops, 3, crop_size, crop_size)
    labels = torch.randint(0, 10, (sample_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return bf.Workload(model, (crops, labels), nn.CrossEntropyLoss(), optimizer)


def accuracy(knobs: dict[str, Any], batch_size: int, workload: bf.Workload) -> dict[str, float]:
    """The measurement a sweep runs with each batch found; here, accuracy on the workload's sample.

    A real experiment would train at ``batch_size`` first and evaluate on held-out data.
    """
    crops, labels = workload.sample_batch
    workload.model.eval()
    with torch.no_grad():
        predictions = workload.model(crops).argmax(dim=1)
    return {"accuracy": (predictions == labels).float().mean().item()}
