"""Op-level (selective) activation checkpointing: which ops' outputs a checkpointed block saves, and which
it recomputes in backward, as policies for torch's ``create_selective_checkpoint_contexts``.

torch's selective checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``, in the
"Selective activation checkpoint" part of torch's checkpoint documentation) takes a policy: a function
``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` asked for every op a checkpointed forward dispatches,
whose answer ``MUST_SAVE`` keeps that op's output for backward and ``PREFER_RECOMPUTE`` runs the op again
there. Two save lists are in common use:

- every matmul saved (torch's documented example saves ``aten.mm``): ``save_all_matmuls=True``; the
  cheap ops around them (norms, activations, elementwise) are recomputed;
- every other matmul saved, torchtitan's op-level policy (its ``selective`` mode with option ``op``,
  ``torchtitan/distributed/activation_checkpoint.py``, whose ``_save_list`` also keeps the attention
  kernels, ``aten.max`` and tensor parallelism's reduce-scatter): about half the matmuls' memory for
  about half their recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torchtitan names ``aten.mm``, the matmul of its bias-free linears; ``aten.addmm`` is the same matmul of a
# linear with a bias, so it is counted with them.
MATMUL_OPS = ("mm", "addmm")
# Every attention kernel SDPA may pick (``..._for_cpu`` is the flash kernel the CPU runs in place of a GPU's),
# and ``aten.max`` (the scale of low-precision training), saved by torchtitan's op-level policy.
SAVED_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "max",
)


def aten_ops(names: tuple[str, ...]) -> set[Any]:
    """The ``.default`` overloads of the aten ops named, skipping any this torch does not have.

    >>> torch.ops.aten.mm.default in aten_ops(("mm", "no_such_op"))
    True
    """
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def selective_policy(*, save_all_matmuls: bool = False) -> Callable[..., Any]:
    """A fresh op-level policy for one checkpointed forward of one block: save the outputs of ``SAVED_OPS``,
    of reduce-scatter, and of every matmul (``save_all_matmuls``) or every other one (the 1st, 3rd, ...:
    torchtitan's rule); recompute everything else. torch asks the policy in forward and replays its answers,
    op by op in dispatch order, when it recomputes (older torch asked again then, with ``ctx.is_recompute``:
    matmuls are counted apart for each pass, as torchtitan counts them, so both passes decide alike).

    >>> from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
    >>> policy, forward = selective_policy(), SelectiveCheckpointContext(is_recompute=False)
    >>> [policy(forward, torch.ops.aten.mm.default).name for _ in range(3)]
    ['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE']
    >>> policy(forward, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    True
    >>> every = selective_policy(save_all_matmuls=True)
    >>> [every(forward, torch.ops.aten.mm.default).name for _ in range(2)]
    ['MUST_SAVE', 'MUST_SAVE']
    """
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = aten_ops(MATMUL_OPS)
    saved = aten_ops(SAVED_OPS) | {torch.ops._c10d_functional.reduce_scatter_tensor.default}
    matmuls_seen = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in matmuls:
            matmuls_seen[ctx.is_recompute] += 1
            keep = save_all_matmuls or matmuls_seen[ctx.is_recompute] % 2 == 1
        else:
            keep = op in saved
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_contexts_of(save_all_matmuls: bool) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: torch's selective-checkpoint contexts over
    a fresh ``selective_policy`` each time it is called (once per checkpointed forward).

    >>> len(selective_contexts_of(True)())
    2
    """

    def contexts() -> tuple[Any, Any]:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(selective_policy(save_all_matmuls=save_all_matmuls))

    return contexts
