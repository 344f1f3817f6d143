"""Built-in workloads: small models of the common kinds, made here, nothing downloaded.

Each builder returns a ``Workload`` with a fixed seed, so runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchfit.bounds import check_size
from batchfit.errors import InputError
from batchfit.step.workload import Workload


class MLPClassifier(nn.Module):
    """Takes a dict batch ``{"features", "labels"}`` and returns ``{"loss", "logits"}`` (HF style)."""

    def __init__(self, features: int = 128, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)
        )

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(features)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    """A residual CNN with BatchNorm for ``(images, labels)`` batches."""

    def __init__(self, channels: int = 32, blocks: int = 2, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(images)).mean(dim=(2, 3)))


KeyValues = tuple[torch.Tensor, torch.Tensor]


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x)[0]

    def attend(self, x: torch.Tensor, past: KeyValues | None = None) -> tuple[torch.Tensor, KeyValues]:
        """The block's output and its keys and values, ``past`` (the KV cache) included."""
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).unbind(dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x)), (k, v)


class TinyGPT(nn.Module):
    """A small decoder-only transformer over token ids."""

    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 2, max_len: int = 512):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.blocks = nn.Sequential(*[DecoderBlock(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.norm(self.blocks(self.tokens(ids) + self.positions(positions))))

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int = 16) -> torch.Tensor:
        """Greedy decoding with a KV cache: the prompt and ``max_new_tokens`` new ids.

        >>> model = TinyGPT(vocab=16, dim=8, heads=2, layers=1, max_len=8)
        >>> model.generate(torch.zeros(3, 2, dtype=torch.long), max_new_tokens=4).shape
        torch.Size([3, 6])
        """
        if ids.shape[1] + max_new_tokens > self.positions.num_embeddings:
            raise InputError(
                f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) is longer than the model's "
                f"max_len ({self.positions.num_embeddings}): build it with a larger max_len"
            )
        caches: list[KeyValues | None] = [None] * len(self.blocks)
        tokens, step, start = ids, ids, 0
        for _ in range(max_new_tokens):
            x = self.tokens(step) + self.positions(torch.arange(start, start + step.shape[1], device=ids.device))
            for index, block in enumerate(self.blocks):
                x, caches[index] = block.attend(x, caches[index])
            step = self.head(self.norm(x[:, -1:])).argmax(dim=-1)
            tokens, start = torch.cat([tokens, step], dim=1), start + x.shape[1]
        return tokens


class TinyLM(nn.Module):
    """A small decoder-only language model called as Hugging Face's are: ``model(input_ids=..., labels=...,
    position_ids=...)`` returns ``{"loss", "logits"}``. A packed row (one row, ``position_ids`` starting again
    at 0 where each sequence starts, as ``DataCollatorWithFlattening`` makes it) is attended one sequence at a
    time, as a varlen attention kernel does: no score matrix spans two sequences."""

    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 2, max_len: int = 512):
        super().__init__()
        self.gpt = TinyGPT(vocab, dim, heads, layers, max_len)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """``attention_mask`` is taken and not needed: attention is causal, so a right-padded row's tokens never
        attend its padding; label the padding -100 to leave it out of the loss."""
        gpt = self.gpt
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = gpt.tokens(input_ids) + gpt.positions(position_ids)
        for block in gpt.blocks:
            x = torch.cat([block(piece) for piece in _sequences(x, position_ids)], dim=1)
        logits = gpt.head(gpt.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return out


def _sequences(x: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
    """The packed sequences of a one-row batch (split where ``position_ids`` is 0); a padded batch whole."""
    if x.shape[0] != 1:
        return [x]
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    bounds = [*(start for start in starts if start > 0), x.shape[1]]
    pieces, begin = [], 0
    for end in bounds:
        pieces.append(x[:, begin:end])
        begin = end
    return pieces


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _check_sizes(**sizes: Any) -> None:
    """The built-ins' sizes must be positive integers: a zero-length sequence would "fit" millions."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive integer, got {value!r}")
        check_size(name, value)


def gpt_tiny(
    seq_len: int = 64,
    amp_dtype: str | None = None,
    sample_size: int = 4,
    layers: int = 2,
    mode: str = "train",
    max_new_tokens: int = 16,
) -> Workload:
    """A 2-layer decoder-only transformer with AdamW on ``(ids, next ids)`` token batches.

    ``layers`` sets the depth; ``mode="generate"`` probes greedy decoding of ``max_new_tokens``
    after a ``seq_len`` prompt, with a KV cache."""
    _check_sizes(seq_len=seq_len, sample_size=sample_size, layers=layers)
    torch.manual_seed(0)
    extra = max_new_tokens if mode == "generate" else 0
    model = TinyGPT(layers=layers, max_len=max(seq_len + extra, 1))
    tokens = torch.randint(0, 512, (sample_size, seq_len + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batch = (tokens[:, :-1], tokens[:, 1:])
    return Workload(
        model, batch, next_token_loss, optimizer, amp_dtype, mode=mode, name="gpt-tiny", max_new_tokens=max_new_tokens
    )


def lm_tiny(seq_len: int = 64, amp_dtype: str | None = None, sample_size: int = 4, layers: int = 2) -> Workload:
    """A 2-layer decoder-only LM with AdamW on Hugging Face style batches {input_ids, labels}; packs sequences."""
    _check_sizes(seq_len=seq_len, sample_size=sample_size, layers=layers)
    torch.manual_seed(0)
    model = TinyLM(layers=layers, max_len=seq_len)
    ids = torch.randint(0, 512, (sample_size, seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return Workload(model, {"input_ids": ids, "labels": ids.clone()}, None, optimizer, amp_dtype, name="lm-tiny")


def cnn_small(image_size: int = 32, amp_dtype: str | None = None, sample_size: int = 4) -> Workload:
    """A residual CNN with BatchNorm and SGD with momentum on ``(images, labels)``."""
    _check_sizes(image_size=image_size, sample_size=sample_size)
    torch.manual_seed(0)
    model = SmallResNet()
    batch = (torch.randn(sample_size, 3, image_size, image_size), torch.randint(0, 10, (sample_size,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return Workload(model, batch, F.cross_entropy, optimizer, amp_dtype, name="cnn-small")


def mlp(features: int = 128, amp_dtype: str | None = None, sample_size: int = 4) -> Workload:
    """An MLP classifier with Adam on a dict batch ``{"features", "labels"}``; the model returns the loss."""
    _check_sizes(features=features, sample_size=sample_size)
    torch.manual_seed(0)
    model = MLPClassifier(features=features)
    batch = {"features": torch.randn(sample_size, features), "labels": torch.randint(0, 10, (sample_size,))}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Workload(model, batch, None, optimizer, amp_dtype, name="mlp")


BUILTIN_WORKLOADS: dict[str, Callable[..., Workload]] = {
    "gpt-tiny": gpt_tiny,
    "lm-tiny": lm_tiny,
    "cnn-small": cnn_small,
    "mlp": mlp,
}
