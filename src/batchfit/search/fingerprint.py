"""A fingerprint of everything that determines a search's answer, for the result cache.

Two searches share a fingerprint when the same model structure (parameter and buffer names,
shapes, dtypes, which ones train) runs the same code (every module class's functions, with what they reach,
and each module's plain attributes: ``model_code``), the same sample (shapes past the batch dimension, dtypes,
nesting), the same loss and step (see ``callable_fields``), the same optimizer class and the
settings that change its state's size, the same AMP dtype and mode, the same device (name and
capacity), the same search bounds and margin, and the same torch and batchfit versions would run.
Settings that leave memory alone (the learning rate, the sample's values) are left out, so changing
them still hits.

A loss or step is keyed by its code and by every value it can see: what it closes over, a
``functools.partial``'s arguments and keywords, its defaults, a bound method's object and the
module globals its code reads, each by a stable representation (no memory addresses), following
the functions it reaches. A value without one (an object of another class: a tokenizer, a file) is
``NotFingerprintable``: the search then runs uncached rather than risk a wrong answer.
"""

from __future__ import annotations

import dataclasses
import dis
import enum
import functools
import hashlib
import json
import logging
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from batchfit import _version
from batchfit.devices.allocator_replay import SETTLE_STEPS
from batchfit.devices.base import Device
from batchfit.step.workload import Workload

REAL_DEVICE_CAPACITY_STEP_BYTES = 64 * 2**20  # a real GPU's free memory drifts by a few MiB between runs
MAX_DEPTH = 8  # values nested deeper than this are not fingerprinted; functions there by name and code only
TENSOR_HASH_MAX_ELEMENTS = 1_000_000  # a captured tensor up to this size is keyed by its contents too
FAILED = "whose value cannot be fingerprinted"
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_BUILTIN_CALLABLES = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)
# Code in these folders (the standard library, installed packages, batchfit) is fixed by the versions
# installed: its functions are keyed by name, code and captured values, not by the globals they read.
_LIBRARY_DIRS = tuple(
    os.path.join(os.path.abspath(folder), "")
    for folder in {
        *(sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")),
        site.getusersitepackages(),
        os.path.dirname(os.path.dirname(__file__)),
    }
)


class NotFingerprintable(ValueError):
    """A loss or step that sees a value without a stable representation; the message is one line
    naming the value and the fix."""

    def __init__(self, field: str, where: tuple[str, ...], value: Any, reason: str = FAILED):
        subject = f"{field} {', which '.join(where) if where else 'is an object'}"
        super().__init__(
            f"not caching: {subject} (a {type(value).__qualname__}) {reason}; pass cache=False, "
            "or use plain values (numbers, strings, tensors, modules, functions)"
        )


class _Walker:
    """One callable's stable representation: JSON-ready data with no ids or addresses."""

    def __init__(self, field: str):
        self.field = field
        self.active: set[int] = set()  # the functions being walked: a cycle is cut, by name
        self.done: dict[int, Any] = {}  # functions already walked, by id (alive for the walk)

    def fail(self, where: tuple[str, ...], value: Any, reason: str = FAILED) -> NotFingerprintable:
        return NotFingerprintable(self.field, where, value, reason)

    def value(self, value: Any, where: tuple[str, ...], depth: int) -> Any:
        """Plain values by ``repr``; tensors, modules, callables and containers by their parts."""
        if isinstance(value, _PLAIN):
            return repr(value)
        if isinstance(value, enum.Enum):
            return f"{type(value).__qualname__}.{value.name}"
        if isinstance(value, torch.Tensor):
            return tensor_value(value)
        if _is_numpy(value):
            return array_value(value)
        if isinstance(value, logging.Logger):  # logging leaves memory alone: by name
            return f"logger {value.name}"
        if isinstance(value, torch.nn.Module):
            return self.module(value, where, depth)
        if isinstance(value, (types.ModuleType, type)) or (callable(value) and not _is_object(value)):
            return self.code(value, where, depth)
        if depth > MAX_DEPTH:
            raise self.fail(where, value, "nested too deeply to fingerprint")
        return self.container(value, where, depth)

    def container(self, value: Any, where: tuple[str, ...], depth: int) -> Any:
        """Tuples, lists, sets, dicts and dataclass instances by their items; anything else fails."""
        kind = type(value).__qualname__
        if isinstance(value, (tuple, list)):
            return [kind, [self.value(v, (*where, f"holds [{i}]"), depth + 1) for i, v in enumerate(value)]]
        if isinstance(value, (set, frozenset)):
            return [kind, sorted(json.dumps(self.value(v, (*where, "holds an item"), depth + 1)) for v in value)]
        if isinstance(value, dict):
            items = [
                [self.value(k, where, depth + 1), self.value(v, (*where, f"holds [{k!r}]"), depth + 1)]
                for k, v in value.items()
            ]
            return [kind, sorted(items, key=json.dumps)]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {
                f.name: self.value(getattr(value, f.name), (*where, f"holds .{f.name}"), depth + 1)
                for f in dataclasses.fields(value)
            }
            return [f"{type(value).__module__}.{kind}", fields]
        raise self.fail(where, value)

    def module(self, module: torch.nn.Module, where: tuple[str, ...], depth: int) -> dict[str, Any]:
        """A module: its class and forward code, structure, parameter shapes and dtypes, and its
        plain settings (numbers, strings: ``label_smoothing``, ``reduction``)."""
        settings = {k: repr(v) for k, v in sorted(vars(module).items()) if not k.startswith("_") and _plain(v)}
        forward = self.code(type(module).forward, (*where, "runs forward"), depth + 1)
        return {**model_fields(module), "forward": forward, "settings": settings}

    def code(self, function: Any, where: tuple[str, ...], depth: int) -> Any:
        """Modules and classes by name; functions, partials and methods by their parts."""
        if isinstance(function, types.ModuleType):
            return f"module {function.__name__}"
        if isinstance(function, type):
            return f"class {function.__module__}.{function.__qualname__}"
        if isinstance(function, functools.partial):
            return self.partial(function, where, depth)
        if isinstance(function, types.MethodType):
            bound = self.value(function.__self__, (*where, "is bound to an object"), depth + 1)
            return {"method": self.code(function.__func__, where, depth + 1), "self": bound}
        if isinstance(function, types.FunctionType):
            return self.function(function, where, depth)
        if isinstance(function, _BUILTIN_CALLABLES):
            return self.builtin(function, where, depth)
        raise self.fail(where, function)

    def partial(self, function: functools.partial, where: tuple[str, ...], depth: int) -> dict[str, Any]:
        args = [self.value(v, (*where, f"passes argument {i}"), depth + 1) for i, v in enumerate(function.args)]
        keywords = {k: self.value(v, (*where, f"passes `{k}`"), depth + 1) for k, v in function.keywords.items()}
        return {"partial": self.code(function.func, where, depth + 1), "args": args, "keywords": keywords}

    def builtin(self, function: Any, where: tuple[str, ...], depth: int) -> Any:
        """A builtin by name, with the object it is bound to unless that is a module or class."""
        owner = getattr(function, "__self__", None)
        name = f"builtin {getattr(function, '__module__', None)}.{getattr(function, '__qualname__', '?')}"
        if owner is None or isinstance(owner, (types.ModuleType, type)):
            return name
        return [name, self.value(owner, (*where, "is bound to an object"), depth + 1)]

    def function(self, function: types.FunctionType, where: tuple[str, ...], depth: int) -> Any:
        """Name, code, defaults, closure and (for code outside installed packages) the globals read.
        A cycle, or a function past ``MAX_DEPTH``, is its name and code only."""
        code = function.__code__
        name = f"{function.__module__}.{function.__qualname__}:{code_digest(code)}"
        if id(function) in self.done:
            return self.done[id(function)]
        if id(function) in self.active or depth > MAX_DEPTH:
            return name
        self.active.add(id(function))
        try:
            self.done[id(function)] = self.function_parts(function, name, where, depth)
        finally:
            self.active.discard(id(function))
        return self.done[id(function)]

    def function_parts(self, function: types.FunctionType, name: str, where: tuple[str, ...], depth: int) -> Any:
        code, cells = function.__code__, function.__closure__ or ()
        closure = {
            n: self.value(_cell(c), (*where, f"closes over `{n}`"), depth + 1)
            for n, c in zip(code.co_freevars, cells, strict=True)
        }
        reads = [] if _is_library(code) else global_names(code)
        scope = function.__globals__
        read = {n: self.value(scope[n], (*where, f"reads the global `{n}`"), depth + 1) for n in reads if n in scope}
        defaults = self.value([function.__defaults__, function.__kwdefaults__], (*where, "has a default"), depth + 1)
        return {"function": name, "defaults": defaults, "closure": closure, "globals": read}


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return None


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value))


def _is_object(value: Any) -> bool:
    """Whether a callable is an instance of some class (not a function, method, partial or builtin)."""
    kinds = (types.FunctionType, types.MethodType, functools.partial, *_BUILTIN_CALLABLES)
    return not isinstance(value, kinds)


def _is_library(code: types.CodeType) -> bool:
    """Code of the standard library, an installed package or batchfit (fixed by their versions)."""
    filename = code.co_filename
    return filename.startswith("<frozen") or os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def global_names(code: types.CodeType) -> list[str]:
    """The module globals ``code`` (and the functions and comprehensions inside it) reads, in order.

    >>> WIDTH = 4
    >>> global_names((lambda x: x * WIDTH + len(x)).__code__)
    ['WIDTH', 'len']
    """
    names = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += global_names(const)
    return list(dict.fromkeys(names))


def callable_fields(function: Callable | None, field: str) -> dict[str, str] | None:
    """A loss or step (``field`` names it in messages) as its name and the SHA-256 of its stable
    representation; ``NotFingerprintable`` when it sees a value without one.

    >>> from functools import partial
    >>> def step(model, batch, max_new_tokens):
    ...     return model.generate(batch, max_new_tokens=max_new_tokens)
    >>> short = callable_fields(partial(step, max_new_tokens=16), "step_fn")
    >>> short == callable_fields(partial(step, max_new_tokens=16), "step_fn")
    True
    >>> short == callable_fields(partial(step, max_new_tokens=4096), "step_fn")
    False
    """
    if function is None:
        return None
    represented = _Walker(field).value(function, (), 0)
    text = json.dumps(represented, sort_keys=True, separators=(",", ":"))
    name = getattr(function, "__qualname__", type(function).__qualname__)
    return {
        "name": f"{getattr(function, '__module__', None)}.{name}",
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }


def code_digest(code: Any) -> str:
    """Bytecode and constants; nested functions by their own digest (their repr holds an address)."""
    consts = [_constant(c) for c in code.co_consts]
    return hashlib.sha256(code.co_code + repr((consts, code.co_names)).encode()).hexdigest()[:16]


def _constant(value: Any) -> str:
    """A code constant's stable text: a nested function's digest, a frozenset's items in order
    (``x in {"a", "b"}`` compiles to one, whose repr order changes with the process's hash seed)."""
    if isinstance(value, types.CodeType):
        return code_digest(value)
    if isinstance(value, frozenset):
        return f"frozenset({sorted(_constant(v) for v in value)})"
    if isinstance(value, tuple):
        return f"({', '.join(_constant(v) for v in value)})"
    return repr(value)


def tensor_value(value: torch.Tensor) -> list[Any]:
    """Shape, dtype and, up to ``TENSOR_HASH_MAX_ELEMENTS`` elements, a digest of the contents."""
    described: list[Any] = ["tensor", list(value.shape), str(value.dtype)]
    if value.numel() > TENSOR_HASH_MAX_ELEMENTS or value.layout != torch.strided or value.device.type == "meta":
        return described
    try:
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError, NotImplementedError):  # a fake or exotic tensor: its shape and dtype only
        return described
    return [*described, hashlib.sha256(data).hexdigest()[:16]]


def _is_numpy(value: Any) -> bool:
    """A NumPy array or scalar of numbers (not of Python objects, whose bytes are addresses)."""
    dtype = getattr(value, "dtype", None)
    return type(value).__module__ == "numpy" and hasattr(value, "tobytes") and not getattr(dtype, "hasobject", True)


def array_value(value: Any) -> list[Any]:
    """A NumPy array or scalar: shape, dtype and, up to ``TENSOR_HASH_MAX_ELEMENTS``, its contents' digest."""
    described: list[Any] = ["array", list(value.shape), str(value.dtype)]
    if value.size > TENSOR_HASH_MAX_ELEMENTS:
        return described
    return [*described, hashlib.sha256(value.tobytes()).hexdigest()[:16]]


def _tensor(value: torch.Tensor, *, drop_batch_dim: bool = False) -> list[Any]:
    shape = list(value.shape[1:] if drop_batch_dim and value.dim() > 0 else value.shape)
    return [shape, str(value.dtype), bool(value.requires_grad)]


def model_fields(model: torch.nn.Module) -> dict[str, Any]:
    """Structure, parameters, buffers and train flags of ``model``."""
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "structure": hashlib.sha256(repr(model).encode()).hexdigest()[:16],
        "parameters": [[name, *_tensor(p)] for name, p in model.named_parameters()],
        "buffers": [[name, *_tensor(b)] for name, b in model.named_buffers()],
        "training": [name for name, m in model.named_modules() if m.training],
        "gradient_checkpointing": getattr(model, "is_gradient_checkpointing", None),
    }


def model_code(model: torch.nn.Module) -> dict[str, Any]:
    """What every module of ``model`` runs and what steers it: each class's code (see ``class_code``) and each
    module's plain attributes and the functions it holds (``repeat = 4``, a functional dropout's ``p``, a
    checkpointing flag, ``self.act = F.gelu``). A module's code that reads a value without a stable
    representation is ``NotFingerprintable``: the search then runs uncached."""
    walker = _Walker("the model")
    classes = {_qualified(cls): class_code(walker, cls) for cls in dict.fromkeys(type(m) for m in model.modules())}
    attributes = []
    for name, module in model.named_modules():
        plain = {k: repr(v) for k, v in sorted(vars(module).items()) if _plain(v)}
        held = {
            k: walker.code(v, (f"holds `{name}.{k}`",), 1)
            for k, v in sorted(vars(module).items())
            if callable(v) and not isinstance(v, (torch.nn.Module, torch.Tensor, type))
        }
        attributes.append([name, plain, held])
    return {"classes": classes, "attributes": attributes}


def class_code(walker: _Walker, cls: type) -> Any:
    """A module class's code: for code outside installed packages, every function its classes define up to
    the first installed one (``forward`` and the helpers it calls through ``self``), with the functions and
    globals they reach; for an installed package's class, its name and the package's version."""
    functions: dict[str, Any] = {}
    for klass in cls.__mro__:
        members = [m.__func__ if isinstance(m, (staticmethod, classmethod)) else m for m in vars(klass).values()]
        code = [m for m in members if isinstance(m, types.FunctionType)]
        if klass in (torch.nn.Module, object) or (code and _is_library(code[0].__code__)):
            functions[_qualified(klass)] = _package_version(klass)
            break
        for function in code:
            functions[f"{_qualified(klass)}.{function.__name__}"] = walker.code(
                function, (f"runs {function.__qualname__}",), 1
            )
    return functions


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _package_version(cls: type) -> str:
    """An installed class by name and its package's version (its code changes with the version)."""
    package = cls.__module__.split(".")[0]
    version = getattr(sys.modules.get(package), "__version__", None)
    return f"{_qualified(cls)} {package} {version}"


def sample_fields(sample: Any) -> dict[str, Any]:
    """The sample's nesting and each leaf's shape past the batch dimension and dtype."""
    leaves, spec = pytree.tree_flatten(sample)
    described = [
        _tensor(leaf, drop_batch_dim=True) if isinstance(leaf, torch.Tensor) else repr(leaf)[:64] for leaf in leaves
    ]
    return {"structure": str(spec), "leaves": described}


def optimizer_fields(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """The class and, per group, the settings that decide the state's size (flags such as
    ``amsgrad``, ``foreach`` or ``fused``, whether there is momentum), not the learning rate."""
    if optimizer is None:
        return None
    groups = []
    for group in optimizer.param_groups:
        flags = {k: v for k, v in group.items() if k != "params" and (isinstance(v, bool) or v is None)}
        flags["momentum"] = bool(group.get("momentum", 0))
        groups.append({"params": len(group["params"]), **flags})
    state = [
        [key, *_tensor(value)]
        for entries in optimizer.state.values()
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
    ]
    return {"class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}", "groups": groups, "state": state}


def device_fields(device: Device) -> dict[str, Any]:
    """The device's name, capacity (a real device's rounded down to 64 MiB: its free memory
    drifts a little between runs, and a cached answer then still applies), caching allocator settings and
    (a simulated device's) block rounding."""
    capacity = device.capacity_bytes()
    if capacity is not None and not device.simulated:
        capacity -= capacity % REAL_DEVICE_CAPACITY_STEP_BYTES
    settings = getattr(device, "allocator_settings", None)  # a caching allocator decides what fits
    return {
        "name": device.name,
        "kind": type(device).__name__,
        "capacity_bytes": capacity,
        "allocator": settings.to_conf() if settings is not None else None,
        "rounding_bytes": getattr(getattr(device, "counter", None), "rounding_bytes", None),  # a simulated block
    }


# What a trial runs, named: a new name whenever it changes what a trial measures (an answer cached before would
# not be the one a search gives now). Now: the loop people write, a batch copied in every step, run on in the
# caching allocator model in four orders until it settles (``batchfit.devices.allocator_replay``).
TRIAL = f"the loop, four orders, settled within {SETTLE_STEPS} steps"


def fingerprint_fields(workload: Workload, device: Device, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every field the fingerprint covers, as JSON-ready data. ``settings`` holds the search's
    own (bounds, margin, steps, strategy options) and anything the caller adds (sweep knobs)."""
    return {
        "model": model_fields(workload.model),
        "code": model_code(workload.model),
        "sample": sample_fields(workload.sample_batch),
        "loss": callable_fields(workload.loss_fn, "loss_fn"),
        "step": callable_fields(workload.step_fn, "step_fn"),
        "optimizer": optimizer_fields(workload.optimizer),
        "amp_dtype": str(workload.amp_dtype),
        "mode": workload.mode,
        "accumulating": getattr(workload, "accumulating", False),
        "keep_output": getattr(workload, "keep_output", True),  # a held output is memory until backward
        "max_new_tokens": workload.max_new_tokens if workload.mode == "generate" else None,
        "device": device_fields(device),
        "settings": dict(settings),
        "torch": torch.__version__,
        "batchfit": _version.__version__,
        "trial": TRIAL,
    }


def fingerprint(fields: Mapping[str, Any]) -> str:
    """The SHA-256 of the fields' canonical JSON.

    >>> fingerprint({"a": 1}) == fingerprint({"a": 1}) != fingerprint({"a": 2})
    True
    """
    text = json.dumps(fields, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
