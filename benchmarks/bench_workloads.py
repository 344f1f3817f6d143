"""Workloads and capacities for the peer benchmark (benchmarks/peers.py), and their true edges.

Three extra models beside the built-ins, tiny and cheap on a CPU: an LSTM classifier, a small
vision transformer and a BatchNorm ResNet with strided stages. Each builder returns a fresh,
seeded ``bf.Workload``, so every method starts from the same bits.

The true edge is a linear scan on the simulated device (1, 2, 3, ... until the first failure),
cached in benchmarks/true_edges.json under the key format of search_strategies.py. The scan here
has no cap (search_strategies.py stops at its 512), and it checks that the measured peak never
decreases as the batch grows: the workloads are monotone, so the first failure is the edge.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.files import atomic_write_text
from batchfit.search.prober import Prober
from batchfit.step.builtin_workloads import cnn_small
from batchfit.step.builtin_workloads import gpt_tiny
from batchfit.step.builtin_workloads import mlp

HERE = Path(__file__).parent
EDGES_PATH = HERE / "true_edges.json"
SCAN_LIMIT = 4096  # a scan that gets here is a mistake in the capacities, not an edge


class LSTMClassifier(nn.Module):
    """Token ids -> embedding -> one LSTM layer -> a class from the last hidden state."""

    def __init__(self, vocab: int = 128, dim: int = 32, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _, (hidden, _) = self.lstm(self.embed(ids))
        return self.head(hidden[-1])


class TinyViT(nn.Module):
    """Patches of a small image -> a class token and two pre-norm encoder blocks -> a class."""

    def __init__(self, image: int = 16, patch: int = 4, dim: int = 48, heads: int = 3, layers: int = 2):
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(images).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.positions
        return self.head(self.norm(self.encoder(tokens))[:, 0])


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, and a strided 1x1 projection when the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.shortcut(x) + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNetBN(nn.Module):
    """A ResNet-style net: a stem and three stages (16, 32, 64 channels, the last two strided)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.stages = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.head = nn.Linear(64, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(images)).mean(dim=(2, 3)))


def lstm() -> bf.Workload:
    """The LSTM classifier with Adam on ``(ids, labels)``, sequences of 24 tokens."""
    torch.manual_seed(0)
    model = LSTMClassifier()
    batch = (torch.randint(0, 128, (4, 24)), torch.randint(0, 10, (4,)))
    return bf.Workload(model, batch, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-3), name="lstm")


def vit() -> bf.Workload:
    """The small ViT with AdamW on 16x16 images."""
    torch.manual_seed(0)
    model = TinyViT()
    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    return bf.Workload(model, batch, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=3e-4), name="vit")


def resnet_bn() -> bf.Workload:
    """The BatchNorm ResNet with SGD and momentum on 16x16 images."""
    torch.manual_seed(0)
    model = ResNetBN()
    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return bf.Workload(model, batch, F.cross_entropy, optimizer, name="resnet-bn")


@dataclass(frozen=True)
class Case:
    """One workload on one simulated capacity."""

    label: str
    build: Callable[[], bf.Workload]
    capacity: str

    @property
    def key(self) -> str:
        """The true edge's key in true_edges.json (the format search_strategies.py uses)."""
        return f"{self.build.__module__}.{self.build.__name__}@{self.capacity}/torch{torch.__version__}"


# Capacities picked so the true edges spread from about 10 to about 1000.
CASES = [
    Case("gpt-tiny (built-in)", gpt_tiny, "22MiB"),
    Case("gpt-tiny (built-in)", gpt_tiny, "40MiB"),
    Case("cnn-small (built-in)", cnn_small, "40MiB"),
    Case("mlp (built-in)", mlp, "7.5MiB"),
    Case("mlp (built-in)", mlp, "14MiB"),
    Case("lstm", lstm, "3MiB"),
    Case("lstm", lstm, "100MiB"),
    Case("vit", vit, "2MiB"),
    Case("vit", vit, "24MiB"),
    Case("resnet-bn", resnet_bn, "2.5MiB"),
    Case("resnet-bn", resnet_bn, "40MiB"),
]


def scan_edge(build: Callable[[], bf.Workload], capacity: str) -> int:
    """Linear scan: probe 1, 2, 3, ... until the first failure; the largest size before it.

    Raises if a measured peak is ever below the one before it: the scan's answer is the edge only
    for a workload whose peak grows with the batch, and this checks that on every size scanned.
    """
    device = bf.SimulatedDevice(capacity)
    previous_peak = 0
    with Prober(build(), device, limit_bytes=device.capacity_bytes()) as prober:
        for size in range(1, SCAN_LIMIT + 1):
            trial = prober.probe(size)
            if not trial.fits:
                return size - 1
            if trial.peak_bytes < previous_peak:
                raise RuntimeError(f"peak fell from {previous_peak} to {trial.peak_bytes} bytes at batch {size}")
            previous_peak = trial.peak_bytes
    raise RuntimeError(f"batch {SCAN_LIMIT} still fits on {capacity}: choose a smaller capacity")


def true_edges(cases: list[Case]) -> dict[str, int]:
    """The true edge of every case, scanned once and cached in true_edges.json (written atomically)."""
    edges = json.loads(EDGES_PATH.read_text()) if EDGES_PATH.exists() else {}
    missing = [case for case in cases if case.key not in edges]
    for case in missing:
        print(f"linear scan for {case.key} ...", flush=True)
        edges[case.key] = scan_edge(case.build, case.capacity)
    if missing:
        atomic_write_text(EDGES_PATH, json.dumps(edges, indent=1, sort_keys=True) + "\n")
    return {case.key: edges[case.key] for case in cases}
