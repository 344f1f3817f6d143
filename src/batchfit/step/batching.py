"""Batches of any nesting: find their tensors, check their length, build a batch of any size.

Containers known to ``torch.utils._pytree`` (tuple, list, dict, namedtuple, ...) are walked by
it; dataclasses and other mappings (Hugging Face ``BatchEncoding``, ``UserDict``) are rebuilt
here because pytree does not know them unless registered, and so is a ``PackedSequence`` (a
namedtuple whose constructor refuses to be rebuilt field by field, see ``_rebuild_packed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils.rnn import PackedSequence
from torch.utils import _pytree as pytree

from batchfit.errors import InputError


def _is_unregistered_container(obj: Any) -> bool:
    if type(obj) in pytree.SUPPORTED_NODES:
        return False
    is_dataclass_instance = dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    return is_dataclass_instance or isinstance(obj, Mapping)


def _is_leaf(node: Any) -> bool:
    """What ``map_tensors`` visits itself rather than through pytree."""
    return isinstance(node, (torch.Tensor, PackedSequence)) or _is_unregistered_container(node)


def _rebuild_mapping(original: Mapping, items: dict) -> Any:
    try:
        return type(original)(items)
    except TypeError:
        return items


def _rebuild_packed(packed: PackedSequence, fn: Callable[[torch.Tensor], Any]) -> PackedSequence:
    """``packed`` with ``fn`` applied to each of its tensors. Rebuilt by ``_make``, which skips
    ``PackedSequence.__new__``: pytree rebuilds a namedtuple through its constructor, which raises
    unless ``batch_sizes`` comes back a CPU tensor (not so when ``fn`` returns ``None``, a size or a
    tensor on a GPU)."""
    return type(packed)._make(fn(field) if isinstance(field, torch.Tensor) else field for field in packed)


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``batch``, keeping its structure and other leaves.

    >>> packed = torch.nn.utils.rnn.pack_sequence([torch.ones(3), torch.ones(2)])
    >>> map_tensors(lambda t: t.shape[0], {"seq": packed})["seq"]
    PackedSequence(data=5, batch_sizes=3, sorted_indices=None, unsorted_indices=None)
    """

    def visit(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            return fn(node)
        if isinstance(node, PackedSequence):
            return _rebuild_packed(node, fn)
        if isinstance(node, Mapping):
            return _rebuild_mapping(node, {key: map_tensors(fn, value) for key, value in node.items()})
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {f.name: map_tensors(fn, getattr(node, f.name)) for f in dataclasses.fields(node) if f.init}
            return dataclasses.replace(node, **changes)
        return node

    return pytree.tree_map(visit, batch, is_leaf=_is_leaf)


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch``, in traversal order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def tensor_bytes(tree: Any) -> int:
    """Bytes of the distinct tensors in ``tree`` (any nesting; ``0`` for ``None``).

    >>> tensor_bytes({"logits": torch.zeros(2, 3), "loss": torch.zeros(())})
    28
    """
    distinct = {id(t): t for t in tensor_leaves(tree)}
    return sum(t.element_size() * t.numel() for t in distinct.values())


def batch_length(batch: Any) -> int:
    """The shared leading (batch) dimension of every non-scalar tensor leaf.

    Raises ``ValueError`` when there is no tensor or when the leading dimensions differ.
    """
    return common_length({t.shape[0] for t in tensor_leaves(batch) if t.dim() > 0}, "tensor")


def common_length(lengths: set[int], kind: str) -> int:
    """The one batch length of a sample's ``kind`` leaves (``"tensor"``, ``"MLX array"``), or a
    ``ValueError`` naming the fix when there is none, several, or it is 0."""
    if not lengths:
        raise InputError(
            f"the sample batch holds no {kind} with a batch dimension: pass one real batch from "
            "your data loader, e.g. next(iter(loader))"
        )
    if len(lengths) > 1:
        raise InputError(
            f"the sample batch's {kind}s have different batch lengths {sorted(lengths)}: every {kind} "
            "needs the same leading dimension (pass a step_fn to handle other layouts)"
        )
    length = lengths.pop()
    if length == 0:
        raise InputError("the sample batch is empty (batch length 0): pass at least one sample")
    return length


def batch_ceiling(dataset: Any, devices: int, limit: int | None = None) -> int | None:
    """``limit``, capped at one device's share of a sized ``dataset`` (rows rounded up): a larger
    batch would never be full. ``None`` when neither bounds it (an iterable dataset, no limit).

    >>> batch_ceiling(range(1000), 3), batch_ceiling(range(1000), 3, limit=64), batch_ceiling(iter([]), 2)
    (334, 64, None)
    """
    try:
        rows = -(-len(dataset) // devices)
    except TypeError:  # an iterable dataset has no length
        return limit
    return rows if limit is None else min(limit, rows)


def bytes_per_sample(batch: Any) -> int:
    """Bytes one sample adds to the batch (the batch tensors' bytes divided by their length)."""
    length = batch_length(batch)
    total = sum(t.element_size() * t.numel() for t in tensor_leaves(batch) if t.dim() > 0)
    return max(1, -(-total // length))


def resize_batch(batch: Any, batch_size: int) -> Any:
    """A batch of ``batch_size`` rows built from ``batch``'s rows, cycled (``arange(B) % n``).

    >>> resize_batch(torch.arange(3), 5).tolist()
    [0, 1, 2, 0, 1]
    """
    length = batch_length(batch)

    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor
        rows = torch.arange(batch_size, device=tensor.device) % length
        return tensor.index_select(0, rows)

    return map_tensors(resize, batch)


def select_rows(batch: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` (indices, repeats allowed) of every batched tensor; scalars kept.

    >>> select_rows({"x": torch.arange(5)}, torch.tensor([4, 0, 4]))
    {'x': tensor([4, 0, 4])}
    """
    return map_tensors(lambda t: t if t.dim() == 0 else t.index_select(0, rows.to(t.device)), batch)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every batched tensor (scalars and non-tensor leaves kept).

    >>> slice_batch({"x": torch.arange(5), "tag": "a"}, 3, 5)
    {'x': tensor([3, 4]), 'tag': 'a'}
    """
    return map_tensors(lambda tensor: tensor if tensor.dim() == 0 else tensor[start:stop], batch)


def pad_sequences(batch: Any, length: int, *, value: int | float = 0) -> Any:
    """Every sequence in ``batch`` padded along dim 1 to ``length``, the worst case a run will hit.

    Tensors with a second dimension shorter than ``length`` are padded with ``value``; masks
    (keys containing ``mask``) with 1, so every padded position is attended, as the longest real
    sequences would be: probe what the real run will hit, not what the sample happens to hold.

    >>> pad_sequences({"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)}, 5)["attention_mask"].sum().item()
    10.0
    """
    if not isinstance(length, int) or length < 1:
        raise InputError(f"the longest sequence length must be a positive integer, got {length!r}")

    def pad(tensor: torch.Tensor, fill: int | float) -> torch.Tensor:
        if tensor.dim() < 2 or tensor.shape[1] >= length:
            return tensor
        shape = (tensor.shape[0], length - tensor.shape[1], *tensor.shape[2:])
        return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)], dim=1)

    if isinstance(batch, Mapping):
        items = {
            key: pad_sequences(item, length, value=1 if "mask" in str(key) else value) for key, item in batch.items()
        }
        return _rebuild_mapping(batch, items)
    return map_tensors(lambda tensor: pad(tensor, value), batch)


def sequence_tensor(batch: Any) -> torch.Tensor | None:
    """The tensor whose dim 1 is ``batch``'s sequence dimension: its first tensor of two or more dimensions.

    >>> sequence_tensor((torch.zeros(2), torch.zeros(2, 7))).shape
    torch.Size([2, 7])
    """
    return next((leaf for leaf in tensor_leaves(batch) if leaf.dim() >= 2), None)


def sequence_widths(batch: Any) -> torch.Tensor | None:
    """Per row, the positions a padded batch must keep for it: up to its last attended position (a right-padded
    row's length) where a mapping batch has a 2-D ``attention_mask``, else the whole sequence dimension (dim 1
    of the first tensor with one); ``None`` without sequences.

    >>> sequence_widths({"input_ids": torch.zeros(2, 5), "attention_mask": torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])})
    tensor([2, 4])
    """
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        return ((mask != 0) * positions).amax(dim=1)
    sequence = sequence_tensor(batch)
    return None if sequence is None else torch.full((sequence.shape[0],), sequence.shape[1])


def cut_sequences(batch: Any, width: int) -> Any:
    """``batch`` with its sequence dimension cut to its first ``width`` positions: every tensor whose dim 1 is
    the batch's sequence length (dim 1 of the first tensor with one) is cut there; the others are kept.

    >>> cut_sequences({"input_ids": torch.arange(8).view(2, 4), "label": torch.tensor([0, 1])}, 2)["input_ids"]
    tensor([[0, 1],
            [4, 5]])
    """
    sequence = sequence_tensor(batch)
    if sequence is None or width >= sequence.shape[1]:
        return batch
    longest = sequence.shape[1]
    return map_tensors(lambda t: t[:, :width].contiguous() if t.dim() >= 2 and t.shape[1] == longest else t, batch)


def is_oversized_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view whose storage holds more than the view itself (``X[:8]`` of a
    large ``X``): counting or keeping its storage would count or keep the whole ``X``.

    >>> data = torch.zeros(100, 4)
    >>> is_oversized_view(data[:8]), is_oversized_view(data), is_oversized_view(torch.zeros(1, 4).expand(8, 4))
    (True, False, False)
    """
    return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()


def compact_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a copy holding only its own elements when it is an oversized view.

    The copy is detached from the caller's tensor (gradients never flow back into it) and keeps
    ``requires_grad``; the caller's tensor is never changed.
    """
    if not is_oversized_view(tensor):
        return tensor
    with torch.no_grad():
        copy = tensor.clone()
    return copy.requires_grad_() if tensor.requires_grad else copy


def compact_batch(batch: Any) -> Any:
    """``batch`` with every oversized view (see ``is_oversized_view``) replaced by a compact copy,
    as ``.to("cuda")`` would copy only its rows; other tensors and leaves are kept as they are.

    >>> data = torch.arange(1000.0).reshape(250, 4)
    >>> small = compact_batch({"x": data[:2], "tag": "a"})
    >>> small["x"].untyped_storage().nbytes(), small["tag"], compact_batch(data) is data
    (32, 'a', True)
    """
    if not any(is_oversized_view(leaf) for leaf in tensor_leaves(batch)):
        return batch  # nothing to copy: the very batch the user gave
    return map_tensors(compact_tensor, batch)


def host_batch(batch: Any) -> Any:
    """``batch`` where a loader builds its rows: tensors on an accelerator copied to the host, others (on the
    CPU, fake or meta tensors) kept as they are.

    >>> host_batch({"x": torch.ones(2)})["x"].device
    device(type='cpu')
    """

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type in ("cpu", "meta") or isinstance(tensor, FakeTensor):
            return tensor
        return tensor.to("cpu")

    return map_tensors(to_host, batch)


def copy_batch(batch: Any, device: torch.device) -> Any:
    """A fresh copy of ``batch`` on ``device``, as a loop's ``batch.to(device)`` makes each step (a copy even
    where the rows are there already: the loop's batch is new memory every step); ``requires_grad`` kept.

    >>> rows = torch.ones(2, 3)
    >>> copy_batch(rows, torch.device("cpu")).untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    True
    """

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            copied = tensor.to(device, copy=True)
        return copied.requires_grad_() if tensor.requires_grad else copied

    return map_tensors(copy, batch)


def move_batch(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device``, holding only its own elements: tensors already
    there are kept as they are, except oversized views, copied compactly (``compact_batch``)."""
    return map_tensors(lambda tensor: compact_tensor(tensor.to(device)), batch)
