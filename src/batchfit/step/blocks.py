"""The repeated blocks of a model: the unit that activation checkpointing (and FSDP2's per-block sharding)
wraps, as torchtitan wraps each transformer block."""

from __future__ import annotations

from torch import nn

Block = tuple[nn.Module, str, nn.Module]  # (parent, name under the parent, block)


def _hf_blocks(model: nn.Module) -> list[Block]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child).__name__ in names:
                found.append((parent, name, child))
    return found


def _container_blocks(model: nn.Module) -> list[Block]:
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = {type(child) for _, child in children}
            if len(children) >= 2 and len(classes) == 1 and list(children[0][1].children()):
                return [(module, name, child) for name, child in children]
    return []


def repeated_blocks(model: nn.Module) -> list[Block]:
    """``(parent, name, block)`` for each repeated block of ``model``, in order: a Hugging Face model's
    ``_no_split_modules`` classes, else the children of the first ``nn.ModuleList``/``nn.Sequential`` of two or
    more modules of one class that have children of their own.

    >>> layers = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    >>> [name for _, name, _ in repeated_blocks(nn.Sequential(nn.Linear(4, 4), layers))]
    ['0', '1', '2']
    """
    return _hf_blocks(model) or _container_blocks(model)
