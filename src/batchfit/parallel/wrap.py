"""Shard a model the way common practice (torchtitan) does, with torch's own FSDP2.

Each repeated block (a Hugging Face model's ``_no_split_modules`` classes, else the modules of the
first ``nn.ModuleList``/``nn.Sequential`` of two or more blocks of one class) is optionally wrapped
for activation checkpointing (torch's non-reentrant ``checkpoint_wrapper``), then given its own
``fully_shard``; then the root is, which takes what is left (embeddings, final norm, head).

``"full"`` checkpointing keeps only each block's input and recomputes the whole block in backward.
``"selective"`` is torchtitan's op-level selective activation checkpointing (its ``selective``
mode with option ``op``, in ``torchtitan/distributed/activation_checkpoint.py``), built from
torch's own ``create_selective_checkpoint_contexts``: inside each block the outputs of the ops
that are expensive to recompute are saved (every other matmul, the SDPA attention kernels,
``aten.max``, reduce-scatter) and the rest (norms, activations, rotary embedding, the other
matmuls) is recomputed in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from batchfit.errors import InputError
from batchfit.parallel.settings import Parallelism
from batchfit.step import recompute_ops
from batchfit.step.blocks import repeated_blocks


def selective_policy() -> Callable[..., Any]:
    """A fresh op-level policy for one checkpointed forward of one block: torchtitan's (every other matmul
    saved, see ``batchfit.step.recompute_ops.selective_policy``); looked up here by ``selective_contexts``."""
    return recompute_ops.selective_policy()


def selective_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of a selectively checkpointed block: torch's selective-checkpoint
    contexts over a fresh ``selective_policy`` (called once per forward of the block)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy())


def _checkpointed(block: nn.Module, checkpointing: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    options = {"context_fn": selective_contexts} if checkpointing == "selective" else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)


def _policies(parallelism: Parallelism) -> dict[str, object]:
    """``fully_shard``'s ``mp_policy`` and ``offload_policy`` for ``parallelism``, where it sets them.
    The offload is not pinned: pinned or not, the host holds the same bytes."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    options: dict[str, object] = {}
    if parallelism.param_dtype is not None or parallelism.reduce_dtype is not None:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=parallelism.param_dtype, reduce_dtype=parallelism.reduce_dtype
        )
    if parallelism.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return options


def shard_model(model: nn.Module, mesh: DeviceMesh, parallelism: Parallelism) -> nn.Module:
    """``model`` prepared in place as ``parallelism`` trains it: each repeated block wrapped for
    activation checkpointing when asked (``"full"`` or ``"selective"``, see the module), then,
    under FSDP2 (``"fsdp"``/``"hybrid"``), each block ``fully_shard``ed over ``mesh`` and then the
    root. Returns the model (FSDP2 changes its class in place). Checkpointing a model without
    repeated blocks is refused: there is nothing to checkpoint. ``"ddp"`` is not wrapped here
    (DistributedDataParallel cannot run on fake tensors). ``cpu_offload`` adds FSDP2's
    ``CPUOffloadPolicy``, refused on a CPU mesh (where it would do nothing)."""
    if parallelism.cpu_offload and mesh.device_type == "cpu":
        raise InputError(
            "cpu_offload moves the sharded state from an accelerator to the host, and on a CPU mesh they are one: "
            "trace it (trace_rank, largest_batch_size, batchfit estimate/plan), which runs one rank on a fake "
            "accelerator"
        )
    blocks = repeated_blocks(model)
    checkpointing = parallelism.activation_checkpointing
    if checkpointing != "none":
        if not blocks:
            raise InputError(
                f"activation_checkpointing={checkpointing!r} checkpoints repeated blocks, and {type(model).__name__} "
                "has none (no nn.ModuleList/nn.Sequential of one block class, no _no_split_modules): use 'none'"
            )
        blocks = [(parent, name, _checkpointed(block, checkpointing)) for parent, name, block in blocks]
        for parent, name, block in blocks:
            parent.register_module(name, block)
    if parallelism.sharding in ("fsdp", "hybrid"):
        from torch.distributed.fsdp import fully_shard

        options = _policies(parallelism)
        for _, _, block in blocks:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
    return model
