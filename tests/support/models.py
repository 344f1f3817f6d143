"""Tiny models of four kinds for the tests: cheap enough that a linear scan is the ground truth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.search.prober import Prober
from batchfit.step.builtin_workloads import MLPClassifier
from batchfit.step.builtin_workloads import TinyGPT
from batchfit.step.builtin_workloads import next_token_loss


def mlp_tuple() -> bf.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    batch = (torch.randn(3, 32), torch.randint(0, 10, (3,)))
    return bf.Workload(model, batch, F.cross_entropy, torch.optim.Adam(model.parameters()), name="mlp")


def cnn_bn() -> bf.Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    batch = (torch.randn(3, 3, 8, 8), torch.randint(0, 10, (3,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return bf.Workload(model, batch, F.cross_entropy, optimizer, name="cnn")


def transformer() -> bf.Workload:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=1, max_len=16)
    tokens = torch.randint(0, 64, (3, 17))
    optimizer = torch.optim.AdamW(model.parameters())
    return bf.Workload(model, (tokens[:, :-1], tokens[:, 1:]), next_token_loss, optimizer, name="transformer")


def dict_model() -> bf.Workload:
    torch.manual_seed(0)
    model = MLPClassifier(features=16, hidden=64)
    batch = {"features": torch.randn(3, 16), "labels": torch.randint(0, 10, (3,))}
    return bf.Workload(model, batch, None, torch.optim.Adam(model.parameters()), name="dict")


@dataclass(frozen=True)
class Case:
    """A workload builder and a simulated capacity whose true edge is a few dozen samples."""

    build: Callable[[], bf.Workload]
    capacity: str

    @property
    def name(self) -> str:
        return self.build.__name__


CASES = [
    Case(mlp_tuple, "160KiB"),
    Case(cnn_bn, "400KiB"),
    Case(transformer, "1MiB"),
    Case(dict_model, "160KiB"),
]


_TRUE_EDGES: dict[str, int] = {}


def linear_scan_edge(case: Case) -> int:
    """The true largest fitting batch size: probe 1, 2, 3, ... until the first failure (once per case)."""
    if case.name not in _TRUE_EDGES:
        device = bf.SimulatedDevice(case.capacity)
        with Prober(case.build(), device, limit_bytes=device.capacity_bytes()) as prober:
            size = 1
            while prober.probe(size).fits:
                size += 1
        _TRUE_EDGES[case.name] = size - 1
    return _TRUE_EDGES[case.name]


def decoder(seq_len: int = 8, layers: int = 1, mode: str = "train", max_new_tokens: int = 8) -> bf.Workload:
    """A tiny decoder whose memory grows with ``seq_len`` and ``layers``: the sweep tests' knobs."""
    torch.manual_seed(0)
    extra = max_new_tokens if mode == "generate" else 0
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=layers, max_len=seq_len + extra)
    tokens = torch.randint(0, 64, (3, seq_len + 1))
    optimizer = torch.optim.AdamW(model.parameters())
    return bf.Workload(
        model,
        (tokens[:, :-1], tokens[:, 1:]),
        next_token_loss,
        optimizer,
        mode=mode,
        max_new_tokens=max_new_tokens,
        name="decoder",
    )
