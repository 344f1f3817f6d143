"""Built-in MLX workloads, the MLX twins of ``batchfit.step.builtin_workloads``: made here, nothing downloaded, seeded."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from batchfit.integrations.mlx.workload import MlxWorkload


class MLPClassifier(nn.Module):
    """Takes ``features`` (and ``labels``) and returns ``{"logits", "loss"}``, like the torch built-in."""

    def __init__(self, features: int = 128, hidden: int = 512, classes: int = 10):
        super().__init__()
        self.layers = [nn.Linear(features, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, classes)]

    def __call__(self, features: mx.array, labels: mx.array | None = None) -> dict[str, mx.array]:
        x = features
        for layer in self.layers[:-1]:
            x = nn.gelu(layer(x))
        logits = self.layers[-1](x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.losses.cross_entropy(logits, labels, reduction="mean")
        return out


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def __call__(self, x: mx.array) -> mx.array:
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        scale = 1 / math.sqrt(dim // self.heads)
        attended = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        x = x + self.proj(attended.transpose(0, 2, 1, 3).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer over token ids."""

    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 2, max_len: int = 512):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.blocks = [DecoderBlock(dim, heads) for _ in range(layers)]
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def __call__(self, ids: mx.array) -> mx.array:
        x = self.tokens(ids) + self.positions(mx.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits: mx.array, targets: mx.array) -> mx.array:
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def mlx_mlp(features: int = 128, sample_size: int = 4) -> MlxWorkload:
    """An MLX MLP classifier with Adam on a dict batch ``{"features", "labels"}``; the model returns the loss.

    >>> mlx_mlp().sample_length
    4
    """
    mx.random.seed(0)
    model = MLPClassifier(features=features)
    batch = {"features": mx.random.normal((sample_size, features)), "labels": mx.random.randint(0, 10, (sample_size,))}
    return MlxWorkload(model, batch, optimizer=optim.Adam(learning_rate=1e-3), name="mlx-mlp")


def mlx_gpt_tiny(seq_len: int = 64, sample_size: int = 4, layers: int = 2) -> MlxWorkload:
    """A 2-layer MLX decoder-only transformer with AdamW on ``(ids, next ids)`` token batches."""
    mx.random.seed(0)
    model = TinyGPT(layers=layers, max_len=max(seq_len, 1))
    tokens = mx.random.randint(0, 512, (sample_size, seq_len + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    return MlxWorkload(model, batch, next_token_loss, optim.AdamW(learning_rate=3e-4), name="mlx-gpt-tiny")
