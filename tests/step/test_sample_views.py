"""A sample that is a view of a bigger tensor (``X[:8]``) counts only its rows, never all of ``X``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.step.batching import compact_batch
from batchfit.step.batching import is_oversized_view
from batchfit.step.batching import move_batch

ROWS = 50_000


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(1)
    return torch.randn(ROWS, 64), torch.randint(0, 4, (ROWS,))


def snapshot(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes(), tensor.clone()


def assert_untouched(tensor: torch.Tensor, before: tuple) -> None:
    pointer, nbytes, values = before
    assert tensor.untyped_storage().data_ptr() == pointer
    assert tensor.untyped_storage().nbytes() == nbytes
    assert torch.equal(tensor, values)


def find(batch, device):
    result = bf.find_max_batch_size(mlp(), batch, loss_fn=F.cross_entropy, optimizer=sgd, device=device)
    return result.batch_size


@pytest.mark.parametrize("device", ["sim:1MiB", bf.TraceDevice("1MiB")], ids=["simulated", "trace"])
def test_a_view_sample_finds_what_its_compact_copy_finds(data, device):
    X, y = data
    before = snapshot(X), snapshot(y)
    view_answer = find((X[:8], y[:8]), device)
    assert view_answer == find((X[:8].clone(), y[:8].clone()), device)
    assert_untouched(X, before[0])
    assert_untouched(y, before[1])


def test_a_view_of_a_tensor_larger_than_the_device_still_starts():
    X, y = torch.randn(2 * ROWS, 64), torch.randint(0, 4, (2 * ROWS,))  # 25 MiB of X on a 1 MiB device
    assert find((X[:8], y[:8]), "sim:1MiB") == find((X[:8].clone(), y[:8].clone()), "sim:1MiB")


def test_probe_counts_only_the_views_rows(data):
    X, y = data
    view = bf.probe_batch_size(mlp(), (X[:8], y[:8]), 64, loss_fn=F.cross_entropy, optimizer=sgd, device="sim:1MiB")
    copy = bf.probe_batch_size(
        mlp(), (X[:8].clone(), y[:8].clone()), 64, loss_fn=F.cross_entropy, optimizer=sgd, device="sim:1MiB"
    )
    assert view.fits and view.peak_bytes == copy.peak_bytes


def test_compact_batch_copies_only_oversized_views():
    data = torch.zeros(100, 4)
    rows, columns, whole, expanded = data[:8], data[:, :2], data, torch.zeros(1, 4).expand(8, 4)
    assert [is_oversized_view(t) for t in (rows, columns, whole, expanded)] == [True, True, False, False]
    compact = compact_batch({"rows": rows, "columns": columns, "whole": whole, "expanded": expanded, "n": 3})
    assert compact["whole"] is whole and compact["expanded"] is expanded and compact["n"] == 3
    assert compact["rows"].untyped_storage().nbytes() == 8 * 4 * 4
    assert compact["columns"].untyped_storage().nbytes() == 100 * 2 * 4
    assert torch.equal(compact["rows"], rows) and torch.equal(compact["columns"], columns)
    assert data.untyped_storage().nbytes() == 100 * 4 * 4  # the caller's tensor is kept whole


def test_compact_copy_keeps_requires_grad_and_never_feeds_the_callers_grad():
    data = torch.randn(100, 4, requires_grad=True)
    compact = compact_batch(data[:8])
    assert compact.requires_grad and compact.is_leaf
    compact.sum().backward()
    assert data.grad is None


def test_move_batch_holds_only_the_rows():
    data = torch.randn(100, 4)
    moved = move_batch((data[:8], data), torch.device("cpu"))
    assert moved[0].untyped_storage().nbytes() == 8 * 4 * 4
    assert moved[1] is data


def test_estimate_counts_only_the_views_rows(data):
    """Needs ``Workload.__post_init__`` to keep a compact sample (``compact_batch``): the estimate
    registers the workload's own sample, not the prober's moved copy."""
    X, y = data
    before = snapshot(X)
    view = bf.estimate_memory(mlp(), (X[:8], y[:8]), batch_size=64, loss_fn=F.cross_entropy, optimizer=sgd)
    copy = bf.estimate_memory(
        mlp(), (X[:8].clone(), y[:8].clone()), batch_size=64, loss_fn=F.cross_entropy, optimizer=sgd
    )
    assert view.peak_bytes == copy.peak_bytes
    assert view.breakdown == copy.breakdown
    assert_untouched(X, before)
