"""Shard a model the way common practice (torchtitan) does, with torch's own FSDP2.

Each repeated block (a Hugging Face model's ``_no_split_modules`` classes, else the modules of the
first ``nn.ModuleList``/``nn.Sequential`` of two or more blocks of one class) is optionally wrapped
for activation checkpointing (torch's non-reentrant ``checkpoint_wrapper``), then given its own
``fully_shard``; then the root is, which takes what is left (embeddings, final norm, head).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from batchfit.errors import InputError
from batchfit.parallel.settings import Parallelism


def _hf_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child).__name__ in names:
                found.append((parent, name, child))
    return found


def _container_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = {type(child) for _, child in children}
            if len(children) >= 2 and len(classes) == 1 and list(children[0][1].children()):
                return [(module, name, child) for name, child in children]
    return []


def repeated_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, block)`` for each repeated block of ``model``, in order.

    >>> from batchfit.parallel.models import TinyTransformer
    >>> [name for _, name, _ in repeated_blocks(TinyTransformer(num_layers=3))]
    ['0', '1', '2']
    """
    return _hf_blocks(model) or _container_blocks(model)


def _checkpointed(block: nn.Module) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _policy(parallelism: Parallelism) -> dict[str, object]:
    if parallelism.param_dtype is None and parallelism.reduce_dtype is None:
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=parallelism.param_dtype, reduce_dtype=parallelism.reduce_dtype)
    return {"mp_policy": policy}


def shard_model(model: nn.Module, mesh: DeviceMesh, parallelism: Parallelism) -> nn.Module:
    """``model`` prepared in place as ``parallelism`` trains it: each repeated block wrapped for
    activation checkpointing when asked, then, under FSDP2 (``"fsdp"``/``"hybrid"``), each block
    ``fully_shard``ed over ``mesh`` and then the root. Returns the model (FSDP2 changes its class
    in place). Checkpointing a model without repeated blocks is refused: there is nothing to
    checkpoint. ``"ddp"`` is not wrapped here (DistributedDataParallel cannot run on fake tensors)."""
    blocks = repeated_blocks(model)
    if parallelism.activation_checkpointing == "full":
        if not blocks:
            raise InputError(
                f"activation_checkpointing='full' checkpoints repeated blocks, and {type(model).__name__} has "
                "none (no nn.ModuleList/nn.Sequential of one block class, no _no_split_modules): use 'none'"
            )
        blocks = [(parent, name, _checkpointed(block)) for parent, name, block in blocks]
        for parent, name, block in blocks:
            parent.register_module(name, block)
    if parallelism.sharding in ("fsdp", "hybrid"):
        from torch.distributed.fsdp import fully_shard

        options = _policy(parallelism)
        for _, _, block in blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
    return model
