"""The values the trace keeps beside its fake tensors, so a step that asks its data a question
gets the answer the real step gets: real copies of what the trace can know (the sample, small
buffers and what ops make from only those, never the parameters), within ``SHADOW_MAX_BYTES`` per
tensor and ``SHADOW_BUDGET_BYTES`` in all, and ``TraceFakeMode``, the fake mode that keeps them,
asks them when a fake kernel cannot answer and runs the rules of ``value_rules``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from batchfit.devices.value_rules import UNKNOWN
from batchfit.devices.value_rules import VALUE_SHAPED_OPS
from batchfit.devices.value_rules import NestedStandIns
from batchfit.devices.value_rules import leaves

# -- what real execution decides: data the trace keeps beside its fake tensors ---------------------
#
# Fake tensors have no values, so a step that asks its data a question stops the trace: a causal
# mask checked for being causal (nn.TransformerEncoder and its layers), a padding mask checked for
# left alignment, `torch.any(var < 0)` (nn.GaussianNLLLoss), rows picked by `nonzero` on the
# targets (nn.AdaptiveLogSoftmaxWithLoss). The values asked about come from the batch, the
# buffers or constants made in forward, never from the parameters, and they are small: the trace
# keeps a real copy beside every fake tensor whose value it can know (the sample's rows, small
# buffers, and whatever an op makes from only such tensors, up to ``SHADOW_MAX_BYTES``), so such a
# question gets the answer the real step gets for the same batch, and an op whose output shape
# depends on values (nonzero, masked indexing) gets a fake output of the real shape. Nothing is
# computed for what depends on the parameters. The real copies are host memory, never counted.
SHADOW_MAX_BYTES = 64 * 2**20  # the largest tensor the trace keeps real values of
SHADOW_BUDGET_BYTES = 256 * 2**20  # the most host memory the kept values take at once
_CPU = torch.device("cpu")
# Ops whose values are garbage until written: nothing to keep (and nothing to allocate for real).
_UNINITIALIZED = frozenset(("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Shadows:
    """The real values beside fake tensors: kept while the fake lives, dropped when a write the
    trace cannot repeat on the real copy (with data it does not know) reaches the fake's storage."""

    def __init__(self) -> None:
        self._values: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}  # id(fake) -> (fake, real, storage)
        self._storages: dict[int, int] = {}  # storage key of a fake with a shadow -> how many
        self.kept_bytes = 0  # of the real copies (a view's counted like its own tensor: an upper bound)

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        same = fake.shape == real.shape and fake.dtype == real.dtype and fake.layout == real.layout == torch.strided
        nbytes = _nbytes(real)
        if not same or isinstance(real, fake_tensor.FakeTensor) or nbytes > SHADOW_MAX_BYTES:
            return
        key, storage = id(fake), fake.untyped_storage()._cdata
        self.drop(key)
        if self.kept_bytes + nbytes > SHADOW_BUDGET_BYTES:
            return
        self._values[key] = (weakref.ref(fake, lambda _ref, k=key: self.drop(k)), real, storage)
        self._storages[storage] = self._storages.get(storage, 0) + 1
        self.kept_bytes += nbytes

    def drop(self, key: int) -> None:
        entry = self._values.pop(key, None)
        if entry is not None:
            self.kept_bytes -= _nbytes(entry[1])
            count = self._storages.pop(entry[2]) - 1
            if count:
                self._storages[entry[2]] = count

    def get(self, fake: torch.Tensor) -> torch.Tensor | None:
        entry = self._values.get(id(fake))
        return entry[1] if entry is not None and entry[0]() is fake else None

    def written(self, fake: torch.Tensor) -> None:
        """``fake``'s storage was written with values the trace does not know: forget them."""
        storage = fake.untyped_storage()._cdata
        if storage in self._storages:
            for key in [k for k, entry in self._values.items() if entry[2] == storage]:
                self.drop(key)


def _all_known(values: Iterable[Any], shadows: _Shadows) -> bool:
    """Whether every fake tensor in ``values`` (and in the lists and tuples in them) has real values kept:
    the quick test before anything is computed, failing at the first parameter-derived one."""
    known = shadows._values
    for value in values:
        if isinstance(value, fake_tensor.FakeTensor):
            if id(value) not in known:
                return False
        elif isinstance(value, (list, tuple)) and not _all_known(value, shadows):
            return False
    return True


def _to_real(value: Any, shadows: _Shadows) -> Any:
    """``value`` with every fake tensor replaced by its real copy (``UNKNOWN`` if one has none) and
    every device by the CPU, where the real copies live."""
    if isinstance(value, (list, tuple)):
        items = [_to_real(item, shadows) for item in value]
        return UNKNOWN if any(item is UNKNOWN for item in items) else type(value)(items)
    if isinstance(value, dict):
        real = {key: _to_real(item, shadows) for key, item in value.items()}
        return UNKNOWN if any(item is UNKNOWN for item in real.values()) else real
    if isinstance(value, fake_tensor.FakeTensor):
        real = shadows.get(value)
        return UNKNOWN if real is None else real
    return _CPU if isinstance(value, torch.device) else value


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The positions and names of the arguments ``func`` writes into (in-place and ``out=`` ops)."""
    arguments = func._schema.arguments
    return tuple((i, arg.name) for i, arg in enumerate(arguments) if arg.alias_info and arg.alias_info.is_write)


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    for index, name in _written_arguments(func):
        yield from leaves(args[index] if index < len(args) else kwargs.get(name))


def _real_call(func: Any, args: tuple, kwargs: dict, shadows: _Shadows) -> Any:
    """What ``func`` returns on the real copies, or ``UNKNOWN`` when an argument has none, the op
    draws random numbers (its values would differ, and the generator would move) or fails."""
    if func.namespace != "aten" or torch.Tag.nondeterministic_seeded in func.tags:
        return UNKNOWN  # (other namespaces: the profiler's records, prims the fake kernels answer)
    if func._schema.name in _UNINITIALIZED:
        return UNKNOWN
    if any(type(t) is torch.Tensor for t in _written_tensors(func, args, kwargs)):
        return UNKNOWN  # a real tensor of the user's, written in place: never on the real copies
    real_args, real_kwargs = _to_real(args, shadows), _to_real(kwargs, shadows) if kwargs else {}
    if real_args is UNKNOWN or real_kwargs is UNKNOWN:
        return UNKNOWN
    if "pin_memory" in real_kwargs:
        real_kwargs["pin_memory"] = False
    try:
        with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            return _unshared(func(*real_args, **real_kwargs), (args, kwargs))
    except Exception:  # a value the trace cannot know, as if never asked
        return UNKNOWN


def _unshared(real: Any, arguments: Any) -> Any:
    """``real`` with each tensor that shares storage with a real (not fake) argument copied: the
    counter counts such an argument (a constant lifted into the trace) until it dies, and a kept
    copy must not keep it alive."""
    given = {t.untyped_storage()._cdata for t in leaves(arguments) if type(t) is torch.Tensor}
    if not given:
        return real
    if isinstance(real, (list, tuple)):
        return type(real)(_unshared(item, arguments) for item in real)
    if isinstance(real, torch.Tensor) and real.untyped_storage()._cdata in given:
        return real.clone()
    return real


def _small(out: Any) -> bool:
    return all(_nbytes(t) <= SHADOW_MAX_BYTES for t in leaves(out) if isinstance(t, torch.Tensor))


def _attach(shadows: _Shadows, out: Any, real: Any) -> None:
    fakes, reals = list(leaves(out)), list(leaves(real))
    if len(fakes) == len(reals):
        for fake, value in zip(fakes, reals, strict=True):
            if isinstance(fake, fake_tensor.FakeTensor) and isinstance(value, torch.Tensor):
                shadows.add(fake, value)


class TraceFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that keeps real values beside fake tensors where it can know them (see
    the comment above) and runs the nested-tensor fast path of ``nn.TransformerEncoder`` (see
    ``NestedStandIns``). Whatever enters this mode gets both: a trial, and a forward pass alone."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.shadows = _Shadows()
        self.nested = NestedStandIns(self)

    def fake_like(self, shape: Any, dtype: torch.dtype, device: torch.device, stride: Any = None) -> torch.Tensor:
        """A new fake tensor (made inside this mode, so a counting mode above counts it as an output)."""
        with self:
            if stride is None:
                return torch.empty(tuple(shape), dtype=dtype, device=device)
            return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=device)

    def keep_copy(self, fake: torch.Tensor, tensor: torch.Tensor) -> None:
        """Keep a real copy of the values of ``tensor`` (a real tensor: the sample, a buffer) beside
        ``fake``, its fake, when small (a copy: the user's tensor is never written)."""
        if tensor.layout == torch.strided and _nbytes(tensor) <= SHADOW_MAX_BYTES:
            with _disable_current_modes():
                self.shadows.add(fake, tensor.detach().to(_CPU, copy=True))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.nested.ids or func._schema.name in self.nested.ENTRIES:
            handled = self.nested.dispatch(func, args, kwargs)
            if handled is not UNKNOWN:
                return handled
        quick = _elementwise_answer(func, args, kwargs, self)
        if quick is not None:
            return quick  # what the fake kernel returns, without its cost (see _elementwise_answer)
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException):
            real = _real_call(func, args, kwargs, self.shadows)
            if real is not UNKNOWN:
                return self.from_real(real, _device_of(args))
            shaped = VALUE_SHAPED_OPS.get(func._schema.name)
            made = shaped(self, *args, **kwargs) if shaped is not None else UNKNOWN
            if made is UNKNOWN:
                raise
            return made
        self._follow(func, args, kwargs, out)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give ``out`` real values where its arguments have them; forget the values of what it
        writes with data the trace does not know."""
        known = _all_known(args, self.shadows) and (not kwargs or _all_known(kwargs.values(), self.shadows))
        wanted = known and isinstance(out, (torch.Tensor, list, tuple)) and _small(out)
        real = _real_call(func, args, kwargs, self.shadows) if wanted else UNKNOWN
        if real is not UNKNOWN:
            _attach(self.shadows, out, real)
        elif _written_arguments(func):
            for tensor in _written_tensors(func, args, kwargs):
                if id(tensor) in self.shadows._values:  # a view without kept values has a base without them
                    self.shadows.written(tensor)

    def value(self, tensor: Any) -> torch.Tensor | None:
        """The real values of ``tensor`` (itself when it is real), or ``None`` when unknown."""
        if isinstance(tensor, fake_tensor.FakeTensor):
            return self.shadows.get(tensor)
        if isinstance(tensor, (list, tuple)) and all(isinstance(item, int) for item in tensor):
            return torch.tensor(tensor, dtype=torch.int64)
        return tensor if isinstance(tensor, torch.Tensor) else None

    def from_real(self, real: Any, device: torch.device) -> Any:
        """Fake tensors of the real outputs' shapes on ``device`` (with those values kept), or the real value."""
        if isinstance(real, (list, tuple)):
            return type(real)(self.from_real(item, device) for item in real)
        if not isinstance(real, torch.Tensor):
            return real
        fake = self.fake_like(real.shape, real.dtype, device, real.stride())
        self.shadows.add(fake, real)
        return fake


# -- element-wise ops: the answer known without the fake kernel ------------------------------------
#
# Most of a step's ops are element-wise on tensors of one shape: an optimizer step (Adam: ``lerp_``,
# ``mul_``, ``addcmul_``, ``sqrt``, ``div``, ``addcdiv_`` per parameter), activations and their
# gradients, a state restore's ``copy_``. Where every tensor is a fake of this mode with the first
# one's shape, dtype (floating) and device, dense, whole and alone in its storage (or the first one
# itself), and every other argument a plain number (or, for the four arithmetic ops, a Python
# number's 0-dim tensor), such an op cannot fail on shapes, dtypes, devices or overlapping memory,
# and its fake kernel's answer is known: the first argument (in place) or a new dense tensor like
# it. The trace gives that answer without the kernel's cost (its cache key, the meta kernel), the
# same fake tensor, storage and bytes. None of the tensors has kept values (see ``_follow``).
_NUMBERS = (int, float, bool)
_REAL_SCALAR_DTYPES = frozenset((torch.float64, torch.int64, torch.bool))  # a Python number's tensor
_ARITHMETIC = frozenset(f"aten::{name}{suffix}" for name in ("add", "sub", "mul", "div") for suffix in ("", "_"))
_SAME_DTYPE_OUT = frozenset(  # out-of-place: a new tensor of the first argument's shape and dtype
    f"aten::{name}"
    for name in [
        "add.Tensor",
        "sub.Tensor",
        "mul.Tensor",
        "div.Tensor",
        "sqrt.default",
        "rsqrt.default",
        "neg.default",
        "exp.default",
        "reciprocal.default",
        "relu.default",
        "sigmoid.default",
        "tanh.default",
        "threshold_backward.default",
        "hardswish.default",
        "hardswish_backward.default",
        "gelu.default",
        "gelu_backward.default",
        "sigmoid_backward.default",
        "tanh_backward.default",
        "silu.default",
        "silu_backward.default",
    ]
)
_IN_PLACE = frozenset(  # in place: the first argument, written
    f"aten::{name}"
    for name in [
        "add_.Tensor",
        "add_.Scalar",
        "sub_.Tensor",
        "sub_.Scalar",
        "mul_.Tensor",
        "mul_.Scalar",
        "div_.Tensor",
        "div_.Scalar",
        "lerp_.Scalar",
        "lerp_.Tensor",
        "addcmul_.default",
        "addcdiv_.default",
        "copy_.default",
        "zero_.default",
        "fill_.Scalar",
        "sqrt_.default",
        "neg_.default",
        "exp_.default",
        "relu_.default",
        "sigmoid_.default",
        "tanh_.default",
    ]
)


@functools.cache
def _elementwise_kind(func: Any) -> str | None:
    """``"in place"`` for one of ``_IN_PLACE``, ``"new"`` for one of ``_SAME_DTYPE_OUT``, else ``None``."""
    if func.namespace != "aten":
        return None
    name = f"{func._schema.name}.{func._overloadname}"
    if name in _IN_PLACE:
        return "in place"
    return "new" if name in _SAME_DTYPE_OUT else None


def _whole(tensor: torch.Tensor) -> bool:
    """Row-major with ``torch.empty``'s strides and alone in its storage: any other such tensor
    shares all of its memory or none, and an element-wise op's output is laid out like it."""
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != _nbytes(tensor):
        return False
    return tuple(tensor.stride()) == tuple(make_contiguous_strides_for(tensor.shape))


def _plain_fake(tensor: Any, mode: TraceFakeMode) -> bool:
    """A fake of ``mode`` with no constant, no kept values, floating, dense and whole."""
    return (
        type(tensor) is fake_tensor.FakeTensor
        and tensor.fake_mode is mode
        and tensor.constant is None
        and tensor.dtype.is_floating_point
        and not tensor.is_neg()
        and id(tensor) not in mode.shadows._values
        and _whole(tensor)
    )


def _like_first(func: Any, kind: str, args: tuple, kwargs: dict, mode: TraceFakeMode) -> bool:
    """Whether every argument after the first is the first's like (see the comment above)."""
    first = args[0]
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, fake_tensor.FakeTensor):
            if value is first:
                continue
            if not _plain_fake(value, mode) or (value.shape, value.dtype, value.device) != (
                first.shape,
                first.dtype,
                first.device,
            ):
                return False
        elif type(value) is torch.Tensor:
            scalar = value.dim() == 0 and value.dtype in _REAL_SCALAR_DTYPES and first.dim() > 0
            if not scalar or func._schema.name not in _ARITHMETIC:
                return False
        elif type(value) not in _NUMBERS and not (kind == "new" and type(value) is str):  # gelu's approximate
            return False
    return True


def _elementwise_answer(func: Any, args: tuple, kwargs: dict, mode: TraceFakeMode) -> torch.Tensor | None:
    """The fake kernel's answer to an element-wise op where it is known without running it (see
    the comment above), else ``None``."""
    kind = _elementwise_kind(func)
    if kind is None or not args or not _plain_fake(args[0], mode) or not _like_first(func, kind, args, kwargs, mode):
        return None
    first = args[0]
    if kind == "in place":
        return first
    with fake_tensor.in_kernel_invocation_manager(mode):
        empty = torch.empty(first.shape, dtype=first.dtype, device="meta")
    return fake_tensor.FakeTensor(mode, empty, first.device)


def _device_of(args: tuple) -> torch.device:
    """The device the first fake argument claims (the CPU when there is none)."""
    return next((t.device for t in leaves(args) if isinstance(t, fake_tensor.FakeTensor)), _CPU)
