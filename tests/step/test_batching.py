"""Batches of any nesting, resized by cycling rows."""

from __future__ import annotations

from collections import UserDict
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from batchfit.step.batching import batch_length
from batchfit.step.batching import bytes_per_sample
from batchfit.step.batching import map_tensors
from batchfit.step.batching import resize_batch
from batchfit.step.batching import tensor_leaves

Pair = namedtuple("Pair", ["inputs", "labels"])


@dataclass
class Features:
    pixels: torch.Tensor
    mask: torch.Tensor
    source: str = "camera"


class Encoding(UserDict):
    """Behaves like Hugging Face's BatchEncoding: a UserDict of tensors."""


def rows(n: int, width: int = 2) -> torch.Tensor:
    return torch.arange(n * width).reshape(n, width)


@pytest.mark.parametrize(
    "batch",
    [
        (rows(3), torch.arange(3)),
        [rows(3), torch.arange(3)],
        {"x": rows(3), "y": torch.arange(3)},
        Pair(rows(3), torch.arange(3)),
        Features(rows(3), torch.ones(3, 4), "scanner"),
        Encoding(input_ids=rows(3), attention_mask=torch.ones(3, 2)),
        {"outer": [(rows(3), {"deep": torch.arange(3)})], "meta": "keep me", "scale": torch.tensor(2.0)},
    ],
    ids=["tuple", "list", "dict", "namedtuple", "dataclass", "batch-encoding", "nested"],
)
def test_any_nesting_is_resized_with_rows_cycled(batch):
    resized = resize_batch(batch, 7)
    assert type(resized) is type(batch)
    assert batch_length(resized) == 7
    cycle = torch.arange(7) % 3
    for before, after in zip(tensor_leaves(batch), tensor_leaves(resized), strict=True):
        if before.dim() == 0:
            assert after is before  # scalars are not batched
        else:
            assert torch.equal(after, before[cycle])


def test_non_tensor_leaves_are_kept():
    resized = resize_batch(Features(rows(2), torch.ones(2, 1), "scanner"), 5)
    assert resized.source == "scanner"
    nested = resize_batch({"x": rows(2), "meta": "keep me"}, 3)
    assert nested["meta"] == "keep me"


def test_shrinking_takes_the_first_rows():
    assert resize_batch(torch.arange(10), 4).tolist() == [0, 1, 2, 3]


def test_bytes_per_sample_counts_every_batched_tensor():
    batch = {"x": torch.zeros(4, 8), "y": torch.zeros(4, dtype=torch.int64), "s": torch.tensor(1.0)}
    assert bytes_per_sample(batch) == 8 * 4 + 8


def test_real_batch_encoding_if_transformers_is_installed():
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": rows(2), "attention_mask": torch.ones(2, 2)})
    resized = resize_batch(encoding, 5)
    assert isinstance(resized, transformers.BatchEncoding) and resized["input_ids"].shape == (5, 2)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"text": "no tensors here"}, "holds no tensor"),
        ((torch.zeros(3, 2), torch.zeros(4)), r"different batch lengths \[3, 4\]"),
        (torch.zeros(0, 3), "empty"),
        (torch.tensor(1.0), "holds no tensor"),
    ],
)
def test_bad_batches_name_the_fix(batch, message):
    with pytest.raises(ValueError, match=message):
        batch_length(batch)


def test_padding_to_the_longest_sequence_makes_the_worst_case():
    from batchfit.step.batching import pad_sequences

    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        "label": torch.tensor([0, 1]),
    }
    padded = pad_sequences(batch, 6, value=7)
    assert padded["input_ids"].shape == (2, 6) and padded["input_ids"][0, 3:].tolist() == [7, 7, 7]
    assert padded["attention_mask"][:, 3:].eq(1).all() and padded["attention_mask"][:, :3].tolist() == [
        [1, 1, 0],
        [1, 0, 0],
    ]
    assert padded["label"].tolist() == [0, 1]  # no sequence dimension: kept
    assert pad_sequences((torch.zeros(2, 8), torch.zeros(2)), 4)[0].shape == (2, 8)  # never truncated
    with pytest.raises(ValueError, match="longest sequence length must be a positive integer"):
        pad_sequences(batch, 0)


def test_the_search_at_the_longest_sequence_finds_a_smaller_batch():
    import batchfit as bf
    from batchfit.step.builtin_workloads import gpt_tiny

    work = gpt_tiny(seq_len=128)  # a model for sequences up to 128 tokens
    ids, targets = work.sample_batch
    short = (ids[:, :32], targets[:, :32])  # but the sample at hand is short
    # A capacity that fits tens of short samples keeps every trial small; the trace is not what is tested.
    kwargs = {
        "loss_fn": work.loss_fn,
        "optimizer": work.optimizer,
        "device": "sim:24MiB",
        "max_batch_size": 512,
        "trace": False,
    }
    at_sample = bf.find_max_batch_size(work.model, short, **kwargs)
    worst = bf.find_max_batch_size(work.model, short, longest_seq_len=128, **kwargs)
    direct = bf.find_max_batch_size(work.model, work.sample_batch, **kwargs)
    assert worst.batch_size < at_sample.batch_size
    assert abs(worst.batch_size - direct.batch_size) <= 1  # the same as a sample that long


def _packed() -> torch.nn.utils.rnn.PackedSequence:
    padded, lengths = torch.arange(24.0).reshape(3, 4, 2), torch.tensor([2, 4, 3])
    return torch.nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)


def test_a_packed_sequence_is_walked_and_rebuilt_as_it_was():
    packed = _packed()
    leaves = tensor_leaves({"seq": packed, "tag": "a"})  # pytree would rebuild it by PackedSequence(None, ...)
    assert [t is f for t, f in zip(leaves, packed, strict=True)] == [True, True, True, True]
    doubled = map_tensors(lambda t: t * 2, (packed, rows(2)))[0]
    assert type(doubled) is type(packed) and torch.equal(doubled.data, packed.data * 2)
    assert torch.equal(doubled.unsorted_indices, packed.unsorted_indices * 2)  # every tensor field, as given
    assert map_tensors(lambda t: None, packed) == (None, None, None, None)


class PackedLSTM(torch.nn.Module):
    """An LSTM over sequences of different lengths, packed: a layer's output is a PackedSequence."""

    def __init__(self, seq: int = 6, width: int = 8):
        super().__init__()
        self.seq, self.width = seq, width
        self.pre, self.lstm = torch.nn.Linear(4, seq * width), torch.nn.LSTM(width, 16, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.pre(x).view(x.shape[0], self.seq, self.width)
        packed = torch.nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        return self.lstm(packed)[0].data


def test_a_model_whose_layer_returns_a_packed_sequence_is_estimated():
    import batchfit as bf

    batch = {"x": torch.randn(4, 4), "lengths": torch.tensor([6, 3, 5, 2])}
    estimate = bf.estimate_memory(PackedLSTM(), batch, 8, loss_fn=lambda out, b: out.pow(2).mean(), device="1GiB")
    assert estimate.peak_bytes > 0 and estimate.breakdown["activations"] > 0
