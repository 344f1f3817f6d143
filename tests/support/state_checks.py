"""What a search must leave as it was: a workload trained a little (so that its state has something to
lose), a fingerprint of that state (tensors, grads, optimizer state, train modes, RNG streams), and a
bitwise comparison of two fingerprints."""

from __future__ import annotations

import random

import numpy as np
import torch

import batchfit as bf


def train_a_little(work: bf.Workload) -> None:
    """Give the state something to lose: optimizer steps taken, grads present, BN stats moved."""
    inputs, targets = work.sample_batch
    for _ in range(2):
        work.optimizer.zero_grad()
        work.loss_fn(work.model(inputs), targets).backward()
        work.optimizer.step()
    work.loss_fn(work.model(inputs), targets).backward()  # leave .grad populated
    next(iter(work.model.children())).eval()  # a mixed train/eval model
    torch.rand(3)
    random.random()


def fingerprint(work: bf.Workload) -> dict:
    model, optimizer = work.model, work.optimizer
    return {
        "tensors": [t.detach().clone() for t in [*model.parameters(), *model.buffers()]],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "optimizer": {
            i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.state[p].items()}
            for i, p in enumerate(model.parameters())
            if p in optimizer.state
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "training": [m.training for m in model.modules()],
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same(before: dict, after: dict) -> None:
    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return (
                isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            )
        if isinstance(a, np.ndarray):
            return bool((a == b).all())
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    for key in before:
        assert same(before[key], after[key]), f"{key} changed"
