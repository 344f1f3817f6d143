"""A small regression problem whose per-example gradients are cheap to compute exactly, and a
seeded loader over it: the gradient noise scale's tests and its two-rank check (ddp_noise.py) share them."""

from __future__ import annotations

import torch
from torch import nn

POPULATION = 64


def regression(seed: int = 0):
    """A float64 MLP and a fixed population small enough for exact per-example gradients."""
    torch.manual_seed(seed)
    inputs = torch.randn(POPULATION, 8, dtype=torch.float64)
    targets = inputs @ torch.randn(8, 1, dtype=torch.float64) + 0.1 * torch.randn(POPULATION, 1, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    return model, inputs, targets


def loader(inputs, targets, batch_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    while True:
        rows = torch.randint(0, POPULATION, (batch_size,), generator=generator)
        yield inputs[rows], targets[rows]
