"""The training loop people write, run as an outside check of an answer under the CUDA caching allocator model.

``loop_failure`` runs a model nobody's trial touched, on a fresh ``SimulatedDevice``: the model copied onto the
device by torch's own ``Module._apply`` (what ``model.to(device)`` runs, in its order), then for every step a batch
of new rows drawn on the host and copied in, ``zero_grad``, forward, loss, backward, ``optimizer.step()``; the
output and loss live until the next step rebinds them. ``LoopOrder`` says where the loop frees the last batch and
the gradients. Nothing of batchfit's step runs here: only its device counts.

``RandomCase`` draws small models of the kinds people train (MLPs with and without BatchNorm, CNNs, a
transformer encoder, an LSTM) with AdamW, Adam or SGD with momentum, and a capacity that leaves room for some
hundreds of rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from soak_loops import Request
from soak_loops import allocator_requests
from soak_loops import to_device_model


@dataclass(frozen=True)
class LoopOrder:
    """Where the loop frees the last step's batch (before the new copy: ``for x, y in loader`` rebinds the
    names first) and the gradients (``zero_grad`` at the top of the step, after the copy, or at its end)."""

    batch_freed_first: bool = False
    zero_grad_first: bool = False


LOOP_ORDERS = tuple(LoopOrder(first, zero) for first in (False, True) for zero in (False, True))
KINDS = ("mlp", "mlp-bn", "cnn", "transformer", "lstm")
OPTIMIZERS = ("adamw", "adam", "sgd-momentum")
CLASSES = 11


@dataclass(frozen=True)
class RandomCase:
    """One small model, its optimizer, a sample of 8 rows and a capacity (bytes), all from ``seed``."""

    kind: str
    width: int
    depth: int
    optimizer: str
    capacity_factor: int  # the capacity in units of the model's parameter bytes (plus 2.5 MiB)
    seed: int

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        model, inputs = _MODELS[self.kind](self.width, self.depth)
        targets = torch.randint(0, CLASSES, (inputs.shape[0],))
        return model, (inputs, targets), _optimizer(self.optimizer, model)

    def capacity_bytes(self) -> int:
        model, _, _ = self.build()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return self.capacity_factor * params + 5 * 2**19  # 2.5 MiB: a small segment (2 MiB) and room beside it

    def __str__(self) -> str:
        return f"{self.kind} {self.width}x{self.depth} {self.optimizer} cap x{self.capacity_factor} seed {self.seed}"


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


class Case(Protocol):
    """What the loop runs: a fresh model, sample and optimizer from ``build()``, a capacity, a seed for its rows."""

    seed: int

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]: ...
    def capacity_bytes(self) -> int: ...


def loop_failure(
    case: Case,
    rows: int,
    allocator: str,
    steps: int = 20,
    order: LoopOrder = LoopOrder(),
    device: bf.SimulatedDevice | None = None,
) -> int | None:
    """``steps`` steps of the hand-written loop at ``rows`` on a fresh device (or ``device``, fresh): ``None``
    when all ran, else the step (1 is the first) that ran out of memory."""
    model, (inputs, targets), optimizer = case.build()
    device = device or bf.SimulatedDevice(case.capacity_bytes(), allocator=allocator)
    generator = torch.Generator().manual_seed(case.seed)
    hosts = [
        (inputs[picked], targets[picked])
        for picked in (torch.randint(0, inputs.shape[0], (rows,), generator=generator) for _ in range(steps))
    ]
    originals = [t.detach() for t in (*model.parameters(), *model.buffers())]  # host copies: kept alive, uncounted
    host_tensors = [t for pair in hosts for t in pair]
    reached = 0
    try:
        with device.measuring(uncounted=[*originals, inputs, targets, *host_tensors]):
            to_device_model(model)  # model.to(device): torch's order, every storage copied once and counted
            batch: Any = None
            out = loss = None
            for x, y in hosts:
                reached += 1
                if order.batch_freed_first:
                    batch = None  # ``for x, y in loader`` rebinds the names before the copy
                batch = (x.clone(), y.clone())
                if order.zero_grad_first:
                    optimizer.zero_grad(set_to_none=True)
                out = model(batch[0])
                loss = loss_fn(out, batch[1])
                loss.backward()
                optimizer.step()
                if not order.zero_grad_first:
                    optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        return reached
    finally:
        del out, loss, batch
    return None


def first_failure(case: Case, rows: int, allocator: str, steps: int = 20) -> tuple[int, LoopOrder] | None:
    """The earliest step at which any loop order runs out of memory at ``rows`` (with that order), or ``None``."""
    failures = [(step, order) for order in LOOP_ORDERS if (step := loop_failure(case, rows, allocator, steps, order))]
    return min(failures, key=lambda failure: failure[0]) if failures else None


@dataclass(frozen=True)
class FiveLinears:
    """Five linear layers with GELU, Adam, 8 rows, a 3.1 MiB device: one small segment of 2 MiB and no room for
    a second, so where each block lands decides. A trial of one cache state said 242 rows fit; the loop ran out
    of memory there at step 2, and at 222 at step 8."""

    seed: int = 3570

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], torch.optim.Optimizer]:
        torch.manual_seed(self.seed)
        hidden = [m for _ in range(3) for m in (nn.Linear(128, 128), nn.GELU())]
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), *hidden, nn.Linear(128, 37))
        sample = (torch.randn(8, 64), torch.randint(0, 37, (8,)))
        return model, sample, torch.optim.Adam(model.parameters(), lr=1e-3)

    def capacity_bytes(self) -> int:
        return 3_296_634


@contextlib.contextmanager
def request_log(device: bf.SimulatedDevice) -> Iterator[list[str]]:
    """Every request (``+bytes``) and free (``-bytes`` of the block) ``device``'s modelled allocator sees while
    active, in order, read when the block ends; a request it cannot serve is marked. Replays of other allocators
    are left out."""
    log: list[str] = []
    with allocator_requests(lambda allocator: allocator is device.counter.allocator) as requests:
        try:
            yield log
        finally:
            log.extend(_as_text(request) for request in requests)


def _as_text(request: Request) -> str:
    kind, nbytes, address = request
    if kind == "free":
        return f"-{nbytes}"
    return f"+{nbytes}" if address is not None else f"+{nbytes} (out of memory)"


# -- the models ------------------------------------------------------------------------------------------------


class _Cnn(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        channels = max(4, width // 8)
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class _Transformer(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        width = max(16, width // 16 * 16)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.embed = nn.Linear(8, width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


class _Lstm(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.lstm = nn.LSTM(8, width, num_layers=min(depth, 2), batch_first=True)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def _mlp(width: int, depth: int, norm: bool = False) -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = [nn.Linear(32, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), *([nn.BatchNorm1d(width)] if norm else []), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES)), torch.randn(8, 32)


_MODELS = {
    "mlp": _mlp,
    "mlp-bn": lambda width, depth: _mlp(width, depth, norm=True),
    "cnn": lambda width, depth: (_Cnn(width, depth), torch.randn(8, 3, 8, 8)),
    "transformer": lambda width, depth: (_Transformer(width, min(depth, 2)), torch.randn(8, 6, 8)),
    "lstm": lambda width, depth: (_Lstm(width, depth), torch.randn(8, 6, 8)),
}


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
