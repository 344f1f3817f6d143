"""Activation checkpointing applied to a model without editing it, and undone afterwards.

A policy names what a training step recomputes in backward instead of keeping from forward:

- ``"none"``: nothing (the model as written);
- ``"full"``: each repeated block (``batchfit.step.blocks.repeated_blocks``) keeps only its input and runs
  its forward again in backward (torch's non-reentrant ``torch.utils.checkpoint.checkpoint``, the variant
  torch's documentation recommends, around the block's forward), as torchtitan's ``full`` mode wraps every
  transformer block;
- ``"full:K"``: the same for every K-th block only (the K-th, 2K-th, ...), torchtitan's layer-selective
  option (``selective_ac_option = "K"``);
- ``"selective"``: each block checkpointed with torch's op-level selective contexts and torchtitan's save
  list, every other matmul and the attention kernels saved (``batchfit.step.recompute_ops``);
- ``"selective-matmuls"``: the same with every matmul saved (the save list of torch's documented example);
- ``"hf"``: a Hugging Face model's own ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
  before transformers 5), non-reentrant.

``checkpointing(model, policy)`` applies one for the length of a ``with`` block. Blocks are checkpointed by
giving each an instance ``forward`` that runs its own forward under ``checkpoint``: no module is replaced or
renamed, so parameter and buffer names, hooks and ``state_dict`` keys are as before. A Hugging Face model's key-value
cache is off while its blocks are checkpointed, as its own checkpointing turns it off. On exit every module's
attributes (and the hooks a policy registered) are put back as they were, whatever happened inside.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from batchfit.errors import InputError
from batchfit.step.blocks import repeated_blocks
from batchfit.step.recompute_ops import selective_contexts_of

POLICIES = ("none", "selective-matmuls", "selective", "full:K", "full", "hf")
"""Every policy, least recomputed first (``full:K`` stands for ``full:2``, ``full:3``, ...)."""
BLOCK_POLICIES = ("full", "selective", "selective-matmuls")
_EVERY = re.compile(r"full:(\d+)")


def _check_policy(policy: str) -> str:
    """``policy`` tidied, or a one-line ``InputError`` naming the policies."""
    tidy = policy.strip().lower() if isinstance(policy, str) else policy
    match = _EVERY.fullmatch(tidy) if isinstance(tidy, str) else None
    if (tidy in POLICIES and tidy != "full:K") or (match and int(match.group(1)) >= 1):
        return tidy
    raise InputError(
        f"unknown activation-checkpointing policy {policy!r}: give none, selective, selective-matmuls, full, "
        "full:K (every K-th block, K >= 1), hf (a Hugging Face model's own), or auto"
    )


def recompute_rank(policy: str) -> tuple[int, int]:
    """How much ``policy`` recomputes, for ordering: none first, then op-level, then every K-th block (fewer
    blocks first), then every block.

    >>> sorted(["full", "full:2", "none", "selective", "full:4"], key=recompute_rank)
    ['none', 'selective', 'full:4', 'full:2', 'full']
    """
    match = _EVERY.fullmatch(policy)
    if match:
        return POLICIES.index("full:K"), -int(match.group(1))
    return POLICIES.index(policy), 0


def has_own_checkpointing(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face model that can checkpoint its own layers."""
    enables = hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")
    return enables and bool(getattr(model, "supports_gradient_checkpointing", False))


def available_policies(model: nn.Module) -> list[str]:
    """The policies ``"auto"`` compares on ``model``: none, selective and full where it has repeated blocks,
    else its own Hugging Face checkpointing where it has that.

    >>> available_policies(nn.Linear(2, 2))
    ['none']
    """
    if repeated_blocks(model):
        return ["none", "selective", "full"]
    return ["none", "hf"] if has_own_checkpointing(model) else ["none"]


def parse_policies(spec: str | Sequence[str], model: nn.Module | None = None) -> list[str]:
    """The policies in ``spec`` (comma-separated, or a list), each checked, duplicates dropped; ``"auto"``
    becomes ``available_policies(model)``.

    >>> parse_policies("none, full:2,full")
    ['none', 'full:2', 'full']
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    if not items or not all(isinstance(item, str) and item.strip() for item in items):
        raise InputError(f"give activation-checkpointing policies such as none,selective,full or auto, got {spec!r}")
    if [item.strip().lower() for item in items] == ["auto"]:
        if model is None:
            raise InputError("auto chooses the policies a model has: give the model")
        return available_policies(model)
    return list(dict.fromkeys(_check_policy(item) for item in items))


class CheckpointedForward:
    """A block's forward run under torch's non-reentrant ``checkpoint`` (with ``context_fn`` where the policy
    is op-level) while gradients are being recorded; called as the forward was, with the same arguments.
    ``policy`` names it (the result cache's fingerprint reads it)."""

    def __init__(self, forward: Callable[..., Any], policy: str, context_fn: Callable[[], Any] | None):
        self.forward, self.policy, self.context_fn = forward, policy, context_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward, so nothing to recompute
            return self.forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        options = {"context_fn": self.context_fn} if self.context_fn is not None else {}
        return checkpoint(self.forward, *args, use_reentrant=False, **options, **kwargs)

    def __repr__(self) -> str:
        return f"CheckpointedForward({self.policy!r})"


def check_applicable(model: nn.Module, policies: Sequence[str]) -> None:
    """A one-line ``InputError`` where a policy cannot apply to ``model``: a block policy on a model without
    repeated blocks, ``hf`` on a model without its own checkpointing.

    >>> check_applicable(nn.Linear(2, 2), ["none", "full"])
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: activation checkpointing 'full' checkpoints repeated blocks, and Linear has none (no nn.ModuleList/nn.Sequential of one block class, no _no_split_modules): use none, or hf for a Hugging Face model
    """
    name = type(model).__name__
    blocky = [p for p in policies if p not in ("none", "hf")]
    if blocky and not repeated_blocks(model):
        raise InputError(
            f"activation checkpointing {blocky[0]!r} checkpoints repeated blocks, and {name} has none "
            "(no nn.ModuleList/nn.Sequential of one block class, no _no_split_modules): use none, or hf for a "
            "Hugging Face model"
        )
    if "hf" in policies and not has_own_checkpointing(model):
        raise InputError(
            f"activation checkpointing 'hf' is a Hugging Face model's own, and {name} has none: use full or "
            "selective (its repeated blocks)"
        )


def _checkpoint_blocks(model: nn.Module, policy: str) -> None:
    check_applicable(model, [policy])
    blocks = [block for _, _, block in repeated_blocks(model)]
    match = _EVERY.fullmatch(policy)
    every = int(match.group(1)) if match else 1
    context_fn = selective_contexts_of(policy == "selective-matmuls") if policy.startswith("selective") else None
    for index, block in enumerate(blocks):
        if (index + 1) % every == 0:
            block.forward = CheckpointedForward(block.forward, policy, context_fn)


def _enable_own(model: nn.Module) -> None:
    check_applicable(model, ["hf"])
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class ModuleAttributes:
    """Every module's attributes as they are now, and the contents of each dict among them (parameters,
    buffers, submodules, hooks); ``restore()`` puts them back: added attributes removed, replaced ones and
    each dict's entries restored in the same dict objects.

    >>> layer = nn.Linear(2, 2)
    >>> saved = ModuleAttributes.take(layer)
    >>> layer.extra, handle = 1, layer.register_forward_hook(lambda *args: None)
    >>> saved.restore()
    >>> hasattr(layer, "extra"), len(layer._forward_hooks)
    (False, 0)
    """

    def __init__(self, saved: list[tuple[nn.Module, dict[str, Any], list[tuple[dict, dict]]]]):
        self.saved = saved

    @classmethod
    def take(cls, model: nn.Module) -> ModuleAttributes:
        """The attributes of ``model`` and each of its modules, now."""
        saved = []
        for module in model.modules():
            attributes = dict(vars(module))
            dicts = [(value, dict(value)) for value in attributes.values() if isinstance(value, dict)]
            saved.append((module, attributes, dicts))
        return cls(saved)

    def restore(self) -> None:
        """Each module's attributes and dicts as they were when taken."""
        for module, attributes, dicts in self.saved:
            for name in [name for name in vars(module) if name not in attributes]:
                del module.__dict__[name]
            module.__dict__.update(attributes)
            for live, contents in dicts:
                live.clear()
                live.update(contents)


@contextmanager
def checkpointing(model: nn.Module, policy: str) -> Iterator[nn.Module]:
    """``model`` with activation checkpointing ``policy`` (see the module) inside the ``with`` block, and as it
    was after it: parameters, buffers, hooks, ``training`` flags and every module attribute.

    >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)])
    >>> with checkpointing(model, "full") as same:
    ...     same is model, model[0].forward
    (True, CheckpointedForward('full'))
    >>> type(model[0].forward).__name__
    'method'
    """
    policy = _check_policy(policy)
    saved = ModuleAttributes.take(model)
    try:
        with _no_cache(model, policy in ("none", "hf")):
            if policy == "hf":
                _enable_own(model)
            elif policy != "none":
                _checkpoint_blocks(model, policy)
            yield model
    finally:
        saved.restore()


@contextmanager
def _no_cache(model: nn.Module, leave: bool) -> Iterator[None]:
    """A Hugging Face model's ``config.use_cache`` off inside (unless ``leave``), as it was after: a block run
    again in backward would append its keys and values to the cache a second time, and attend to both (the
    model's own checkpointing turns the cache off in training for the same reason)."""
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if leave or cached is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = cached
