"""Fake outputs the trace makes where a fake kernel cannot, from values it keeps (see
``fake_values``): rules giving ops whose output shape depends on values (``pack_padded_sequence``,
``nn.CTCLoss``) fake outputs of the real shapes (``VALUE_SHAPED_OPS``), and the dense stand-ins
that run the nested-tensor fast path of ``nn.TransformerEncoder`` (``NestedStandIns``); with the
``UNKNOWN`` marker of a value the trace cannot know and ``leaves``, the items of an op's arguments.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import Protocol

import torch
from torch._subclasses import fake_tensor
from torch.utils._python_dispatch import _disable_current_modes

from batchfit.errors import TraceError

UNKNOWN = object()  # a value the trace cannot know


class KeptValues(Protocol):
    """The real values a fake mode keeps beside its fake tensors."""

    def get(self, fake: torch.Tensor) -> torch.Tensor | None: ...


class ValueMode(Protocol):
    """What these rules ask of the fake mode that runs them: ``fake_values.TraceFakeMode`` (which imports this
    module), entered to make fakes, with its kept values, the values of a tensor and new fake tensors."""

    shadows: KeptValues

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc_info: object) -> Any: ...
    def value(self, tensor: Any) -> torch.Tensor | None: ...
    def fake_like(self, shape: Any, dtype: torch.dtype, device: torch.device, stride: Any = None) -> torch.Tensor: ...


def leaves(value: Any) -> Iterator[Any]:
    """The items of ``value`` and of the lists, tuples and dicts in it (an op's arguments)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    else:
        yield value


def _pack_padded(mode: ValueMode, input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> Any:
    """``aten._pack_padded_sequence`` (``pack_padded_sequence``): the packed rows are the sum of the
    lengths, whose values the trace keeps; the real kernel runs on a stand-in without data. The
    batch sizes stay real, as the recurrent layers' C++ reads them (a small host tensor, as in
    the real step)."""
    values = mode.value(lengths)
    if values is None or input.dim() < 2:
        return UNKNOWN
    with _disable_current_modes():
        data, batch_sizes = torch._pack_padded_sequence(torch.zeros(()).expand(input.shape[:2]), values, batch_first)
    return mode.fake_like((data.shape[0], *input.shape[2:]), input.dtype, input.device), batch_sizes


def _ctc_loss(mode: ValueMode, log_probs: torch.Tensor, targets, input_lengths, target_lengths, *rest) -> Any:
    """``aten._ctc_loss`` (``nn.CTCLoss``): the loss per row and the alphas, (batch, time,
    2 * longest target + 1), the longest target read from the kept lengths."""
    values = mode.value(target_lengths)
    if values is None or log_probs.dim() != 3:
        return UNKNOWN
    steps, rows = log_probs.shape[:2]
    width = 2 * int(values.max()) + 1 if values.numel() else 1
    return (
        mode.fake_like((rows,), log_probs.dtype, log_probs.device),
        mode.fake_like((rows, steps, width), log_probs.dtype, log_probs.device),
    )


# Ops whose output shapes depend on values the trace keeps, though not all their inputs have
# kept values (by name, any overload): each rule makes fake outputs of the real shapes, or
# returns ``UNKNOWN``.
VALUE_SHAPED_OPS: dict[str, Callable[..., Any]] = {
    "aten::_pack_padded_sequence": _pack_padded,
    "aten::_ctc_loss": _ctc_loss,
}


class NestedStandIns:
    """The nested-tensor fast path of ``nn.TransformerEncoder`` (eval with a padding mask) on fake
    tensors, which cannot be nested. The real step packs the unpadded tokens into one nested buffer
    (``aten._nested_tensor_from_mask``), runs each fused layer on it and pads the result back
    (``aten.to_padded_tensor``). Here the nested tensor is stood in for by a dense fake of shape
    (1, tokens, width): the same bytes as the nested buffer (the token count is read from the
    mask's real values), which each fused layer (``aten._transformer_encoder_layer_fwd``) maps
    to another stand-in, as the real kernel maps a nested buffer to one of the same size. Any other
    op on a stand-in is a ``TraceError``."""

    LAYER, FROM_MASK, ALIGNED, PADDED = (
        "aten::_transformer_encoder_layer_fwd",
        "aten::_nested_tensor_from_mask",
        "aten::_nested_tensor_from_mask_left_aligned",
        "aten::to_padded_tensor",
    )
    ENTRIES = frozenset((FROM_MASK, ALIGNED))  # the ops that start the fast path

    def __init__(self, mode: ValueMode) -> None:
        self.mode = mode
        self.ids: dict[int, weakref.ref] = {}
        self.inside = 0  # > 0 while a fused layer runs on a stand-in (its own ops are its business)

    def _add(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor)
        self.ids[key] = weakref.ref(tensor, lambda _ref, k=key: self.ids.pop(k, None))
        return tensor

    def _is_stand_in(self, value: Any) -> bool:
        ref = self.ids.get(id(value))
        return ref is not None and ref() is value

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """What the fast path's op returns on the trace, or ``UNKNOWN`` for an op it leaves alone."""
        name = func._schema.name
        if name == self.FROM_MASK:
            return self._from_mask(*args, **kwargs)
        if name == self.ALIGNED:
            return self._left_aligned(*args)
        if self.inside or not self.ids or not any(self._is_stand_in(a) for a in leaves((args, kwargs))):
            return UNKNOWN
        if name == self.PADDED:
            return self._padded(*args, **kwargs)
        if name != self.LAYER:
            raise TraceError(
                f"cannot trace this workload on fake tensors ({name} on the nested-tensor fast path of "
                "nn.TransformerEncoder); measure it with `batchfit find` on a real or simulated device instead"
            )
        self.inside += 1
        try:
            with self.mode:
                return self._add(func(*args, **kwargs))
        finally:
            self.inside -= 1

    def _mask_values(self, mask: torch.Tensor) -> torch.Tensor:
        real = self.mode.shadows.get(mask) if isinstance(mask, fake_tensor.FakeTensor) else mask
        if real is None:
            raise TraceError(
                "cannot trace this workload on fake tensors (the nested-tensor fast path of "
                "nn.TransformerEncoder needs the padding mask's values, which come from the parameters "
                "or exceed what the trace keeps); measure it with `batchfit find` on a real or simulated "
                "device instead, or trace it in train mode"
            )
        return real

    def _from_mask(self, t: torch.Tensor, mask: torch.Tensor, mask_check: bool = True) -> torch.Tensor:
        tokens = int(self._mask_values(mask).sum())
        return self._add(self.mode.fake_like((1, tokens, t.shape[-1]), t.dtype, t.device))

    def _left_aligned(self, t: torch.Tensor, mask: torch.Tensor) -> bool:
        values = self._mask_values(mask)
        with _disable_current_modes():  # only the mask's values matter: the input's shape, no data
            return bool(torch._nested_tensor_from_mask_left_aligned(torch.zeros(()).expand(t.shape), values))

    def _padded(self, nested: torch.Tensor, padding: float, output_size: Any = None) -> torch.Tensor:
        if output_size is None:
            raise TraceError(
                "cannot trace this workload on fake tensors (to_padded_tensor without an output size on "
                "the nested-tensor fast path); measure it with `batchfit find` on a real or simulated device instead"
            )
        return self.mode.fake_like(output_size, nested.dtype, nested.device)
