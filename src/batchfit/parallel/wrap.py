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

import torch
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


# Selective checkpointing saves what torchtitan's op-level policy saves (its ``_save_list``): the
# matmuls, every attention kernel SDPA may pick (``..._for_cpu`` is the flash kernel that a trace on
# the CPU runs in place of a GPU's), ``aten.max`` (the scale of low-precision training) and the
# reduce-scatter of tensor parallelism. torchtitan names ``aten.mm``, the matmul of its bias-free
# linears; ``aten.addmm`` is the same matmul of a linear with a bias, so it is counted with them.
MATMUL_OPS = ("mm", "addmm")
SAVED_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "max",
)


def _aten_ops(names: tuple[str, ...]) -> set[Any]:
    """The ``.default`` overloads of the aten ops named, skipping any this torch does not have."""
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def selective_policy() -> Callable[..., Any]:
    """A fresh op-level policy for one checkpointed forward of one block, for
    ``create_selective_checkpoint_contexts``: save the outputs of ``SAVED_OPS``, of reduce-scatter,
    and of every other matmul (the 1st, 3rd, ...: torchtitan's rule, which halves what the matmuls
    keep for about half their recompute); recompute everything else. torch asks the policy in
    forward and replays its answers, op by op in dispatch order, when it recomputes (older torch
    asked again then, with ``ctx.is_recompute``: matmuls are counted apart for each pass, as
    torchtitan counts them, so both passes decide alike).

    >>> from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
    >>> policy, forward = selective_policy(), SelectiveCheckpointContext(is_recompute=False)
    >>> [policy(forward, torch.ops.aten.mm.default).name for _ in range(3)]
    ['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE']
    >>> policy(forward, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    True
    """
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = _aten_ops(MATMUL_OPS)
    saved = _aten_ops(SAVED_OPS) | {torch.ops._c10d_functional.reduce_scatter_tensor.default}
    matmuls_seen = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in matmuls:
            matmuls_seen[ctx.is_recompute] += 1
            keep = matmuls_seen[ctx.is_recompute] % 2 == 1
        else:
            keep = op in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


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
