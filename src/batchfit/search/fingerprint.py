"""A fingerprint of everything that determines a search's answer, for the result cache.

Two searches share a fingerprint when the same model structure (parameter and buffer names,
shapes, dtypes, which ones train), the same sample (shapes past the batch dimension, dtypes,
nesting), the same loss and step code, the same optimizer class and the settings that change its
state's size, the same AMP dtype and mode, the same device (name and capacity), the same search
bounds and margin, and the same torch and batchfit versions would run. Settings that leave memory
alone (the learning rate, the sample's values) are left out, so changing them still hits.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from batchfit import _version
from batchfit.devices.base import Device
from batchfit.step.workload import Workload

REAL_DEVICE_CAPACITY_STEP_BYTES = 64 * 2**20  # a real GPU's free memory drifts by a few MiB between runs


def _code(function: Callable | None) -> str | None:
    """A function's name and a digest of its bytecode and constants: an edited loss misses."""
    if function is None:
        return None
    if isinstance(function, functools.partial):
        return f"partial({_code(function.func)}, args={len(function.args)}, keywords={sorted(function.keywords)})"
    if isinstance(function, torch.nn.Module):  # a loss module: its class and settings
        return f"{type(function).__module__}.{type(function).__qualname__}:{function!r}"
    target = getattr(function, "__func__", function)
    code = getattr(target, "__code__", None)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__qualname__)}"
    if code is None:  # a builtin, a functools.partial or a callable object: its name only
        return f"{name}:{getattr(function, '__name__', repr(type(function)))}"
    return f"{name}:{_code_digest(code)}"


def _code_digest(code: Any) -> str:
    """Bytecode and constants; nested functions by their own digest (their repr holds an address)."""
    consts = [_code_digest(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return hashlib.sha256(code.co_code + repr((consts, code.co_names)).encode()).hexdigest()[:16]


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
    """The device's name and capacity (a real device's rounded down to 64 MiB: its free memory
    drifts a little between runs, and a cached answer then still applies)."""
    capacity = device.capacity_bytes()
    if capacity is not None and not device.simulated:
        capacity -= capacity % REAL_DEVICE_CAPACITY_STEP_BYTES
    return {"name": device.name, "kind": type(device).__name__, "capacity_bytes": capacity}


def fingerprint_fields(workload: Workload, device: Device, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Every field the fingerprint covers, as JSON-ready data. ``settings`` holds the search's
    own (bounds, margin, steps, strategy options) and anything the caller adds (sweep knobs)."""
    return {
        "model": model_fields(workload.model),
        "sample": sample_fields(workload.sample_batch),
        "loss": _code(workload.loss_fn),
        "step": _code(workload.step_fn),
        "optimizer": optimizer_fields(workload.optimizer),
        "amp_dtype": str(workload.amp_dtype),
        "mode": workload.mode,
        "accumulating": getattr(workload, "accumulating", False),
        "max_new_tokens": workload.max_new_tokens if workload.mode == "generate" else None,
        "device": device_fields(device),
        "settings": dict(settings),
        "torch": torch.__version__,
        "batchfit": _version.__version__,
    }


def fingerprint(fields: Mapping[str, Any]) -> str:
    """The SHA-256 of the fields' canonical JSON.

    >>> fingerprint({"a": 1}) == fingerprint({"a": 1}) != fingerprint({"a": 2})
    True
    """
    text = json.dumps(fields, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
