"""The sample batches a token budget is measured on: a padded batch at each bucket's longest sequence, and a
packed batch whose rows are tokens.

A padded sample holds its sequences along dimension 1 (``(batch, seq_len, ...)``: token ids, labels, an
attention mask). A packed batch is what ``DataCollatorWithFlattening`` and verl's remove-padding hand a
model: one row of sequences laid end to end, ``position_ids`` starting again at 0 where each sequence starts
(from which the attention kernel finds the sequences' bounds, ``cu_seqlens``), and no attention mask. Here
its tokens are the rows of 1-D tensors, so that the search sizes a packed micro-batch in tokens as it sizes
any batch in rows; ``PackedRows`` gives the model its row back.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.step.batching import cut_sequences
from batchfit.step.batching import map_tensors
from batchfit.step.batching import pad_sequences
from batchfit.step.batching import sequence_tensor
from batchfit.step.batching import tensor_leaves

MASK_KEYS = ("attention_mask",)  # a packed batch has none: the sequences' bounds are in position_ids


def sequence_length(sample: Any) -> int:
    """The sample's sequence length: dimension 1 of its first tensor of two or more dimensions.

    >>> sequence_length({"input_ids": torch.zeros(2, 128, dtype=torch.long)})
    128
    """
    sequence = sequence_tensor(sample)
    if sequence is None:
        raise InputError(
            "a token budget needs sequences: give a sample whose tensors are (batch, seq_len, ...), such as "
            "{'input_ids': ..., 'labels': ...} or (ids, next_ids)"
        )
    return sequence.shape[1]


def at_length(sample: Any, seq_len: int) -> Any:
    """``sample`` at ``seq_len`` positions, as a padded bucket's batch arrives: every tensor whose dimension 1
    is the sample's sequence length is cut there (a compact copy), or padded to it as ``pad_sequences`` pads
    (masks with ones: every position attended, the longest a bucket holds); the others are kept. An
    ``attention_mask`` gets one padded position (its last row's last): a bucket's rows differ in length, and
    a model whose mask is not all ones takes its masked attention path (Hugging Face's builds a 4-D mask,
    and SDPA cannot use its fused kernels), which holds more.

    >>> at_length({"input_ids": torch.arange(8).view(2, 4), "label": torch.tensor([0, 1])}, 2)["input_ids"]
    tensor([[0, 1],
            [4, 5]])
    """
    if seq_len > sequence_length(sample):
        check_host_room(sample, seq_len)
        return with_padding(pad_sequences(sample, seq_len))
    return with_padding(cut_sequences(sample, seq_len))


def padded_bytes(sample: Any, seq_len: int) -> int:
    """The host bytes ``sample`` takes padded to ``seq_len`` positions (its real tensors of two dimensions or more;
    a fake tensor takes none).

    >>> padded_bytes({"input_ids": torch.zeros(2, 4, dtype=torch.long), "label": torch.zeros(2)}, 1024)
    16384
    """
    return sum(
        tensor.numel() // max(tensor.shape[1], 1) * seq_len * tensor.element_size()
        for tensor in tensor_leaves(sample)
        if tensor.dim() >= 2 and not isinstance(tensor, FakeTensor)
    )


def check_host_room(sample: Any, seq_len: int, available_bytes: int | None = None) -> None:
    """An ``InputError`` before padding, where ``sample`` at ``seq_len`` positions would take more than half the
    memory the host can still give (``available_bytes``, read from the host when ``None``): a bucket longer than
    any sequence the run will see is a mistake, not a reason to swap."""
    needed = padded_bytes(sample, seq_len)
    if available_bytes is None:
        from batchfit.devices.cpu import available_host_bytes

        available_bytes = available_host_bytes()
    if available_bytes is not None and needed > available_bytes // 2:
        raise InputError(
            f"the sample padded to {seq_len:,} tokens would take {format_bytes(needed)} of host memory, which has "
            f"{format_bytes(available_bytes)} available: give the bucket lengths your data has (--buckets, --max-seq-len)"
        )


def with_padding(sample: Any) -> Any:
    """``sample`` with its 2-D ``attention_mask``'s last position of the last row set to 0 (a copy; the
    sample is not changed); a sample without one as it is."""
    mask = sample.get("attention_mask") if isinstance(sample, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return sample
    padded = mask.clone()
    padded[-1, -1] = 0
    return {**sample, "attention_mask": padded}


def takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (by name, or through ``**kwargs``)."""
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "position_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def packing_refusal(model: nn.Module, sample: Any) -> str | None:
    """Why ``sample`` cannot be packed for ``model`` (``None``: it can): a packed batch is a mapping, as a
    Hugging Face collator makes, for a model that takes ``position_ids``."""
    if not isinstance(sample, Mapping):
        return (
            "a packed batch needs a mapping sample ({'input_ids', 'labels', ...}) for a model that takes "
            "position_ids; this sample is a " + type(sample).__name__
        )
    if not takes_position_ids(model):
        return f"{type(model).__name__}.forward takes no position_ids, which tell a packed batch's sequences apart"
    return None


def packed_rows(sample: Mapping[str, Any], seq_len: int) -> dict[str, Any]:
    """One sequence of ``seq_len`` tokens as a packed batch whose rows are tokens: each sequence tensor's first
    row, ``position_ids`` ``0 .. seq_len - 1``, no attention mask. Cycled to ``T`` rows (as the search builds
    every batch), it is ``T`` tokens of sequences ``seq_len`` long, the last one cut short.

    >>> rows = packed_rows({"input_ids": torch.arange(6).view(2, 3), "attention_mask": torch.ones(2, 3)}, 3)
    >>> rows["input_ids"].tolist(), rows["position_ids"].tolist(), "attention_mask" in rows
    ([0, 1, 2], [0, 1, 2], False)
    """
    cut = at_length(sample, seq_len)
    rows = {key: value[0] for key, value in cut.items() if key not in MASK_KEYS and _is_sequence(value, seq_len)}
    if not rows:
        raise InputError("a packed batch needs sequence tensors of shape (batch, seq_len, ...) in the sample")
    device = next(iter(rows.values())).device
    rows["position_ids"] = torch.arange(seq_len, device=device)
    return rows


def _is_sequence(value: Any, seq_len: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len


class PackedRows(nn.Module):
    """``model`` fed a packed batch whose rows are tokens: each tensor gets its batch dimension of one back
    (``(T,)`` becomes ``(1, T)``), as a collator that flattens hands it over. The parameters are ``model``'s
    own; nothing is copied.

    >>> inner = nn.Embedding(10, 2)
    >>> PackedRows(inner)(input=torch.tensor([1, 2, 3])).shape
    torch.Size([1, 3, 2])
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch: Any) -> Any:
        return self.model(**map_tensors(lambda tensor: tensor.unsqueeze(0), batch))
