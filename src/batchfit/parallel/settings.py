"""``Parallelism``: how many ranks train, how the model is sharded across them, and which rank to measure."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchfit.errors import InputError
from batchfit.errors import InputTypeError

SHARDINGS = ("fsdp", "hybrid", "ddp", "none")
CHECKPOINTING = ("none", "selective", "full")
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def dtype_of(value: torch.dtype | str | None, name: str) -> torch.dtype | None:
    """``value`` as a floating ``torch.dtype`` (names such as ``"bf16"`` accepted), or ``None``.

    >>> dtype_of("bf16", "param_dtype")
    torch.bfloat16
    """
    if value is None or (isinstance(value, torch.dtype) and value in DTYPES.values()):
        return value
    if isinstance(value, str) and value.strip().lower() in DTYPES:
        return DTYPES[value.strip().lower()]
    raise InputError(
        f"{name} must be torch.float32, torch.bfloat16, torch.float16, 'fp32', 'bf16', 'fp16' or None, got {value!r}"
    )


REAL_OFFLOAD_REFUSAL = (
    "cpu_offload is traced for a model built from its config (a preset, a config.json, a transformers config "
    "or an importable function: batchfit estimate/plan --cpu-offload, trace_rank, largest_batch_size); real "
    "trials of one rank run on one device, where host and device are one, and a Workload of one's own is "
    "traced as one rank's copy, without it"
)


def _positive_int(value: object, name: str, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError(f"{name} must be an integer such as {example}, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InputError(f"{name} must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class Parallelism:
    """How training is spread over ranks (processes, one per GPU), and which rank an estimate measures.

    >>> Parallelism(world_size=16, gpus_per_node=8, sharding="hybrid").mesh_shape()
    (2, 8)
    >>> Parallelism(world_size=8).shard_ranks()
    8
    """

    world_size: int = 1
    """How many ranks train together (GPUs in all nodes)."""

    gpus_per_node: int | None = None
    """Ranks per node; ``None`` means all ranks share one node. ``"hybrid"`` sharding needs it."""

    sharding: str = "fsdp"
    """``"fsdp"``: FSDP2 full shard (parameters, gradients and optimizer state split over every rank);
    ``"hybrid"``: FSDP2 hybrid shard (split within a node, replicated across nodes); ``"ddp"``: every
    rank holds the whole model (DistributedDataParallel); ``"none"``: one process, no sharding."""

    param_dtype: torch.dtype | str | None = None
    """FSDP2's ``MixedPrecisionPolicy.param_dtype``: the dtype parameters are all-gathered and
    computed in (e.g. ``"bf16"`` over fp32 sharded parameters); ``None``: no policy, compute in
    the parameters' own dtype."""

    reduce_dtype: torch.dtype | str | None = None
    """FSDP2's ``MixedPrecisionPolicy.reduce_dtype``: the dtype gradients are reduce-scattered in
    (e.g. ``"fp32"``); ``None``: the policy's default (``param_dtype``)."""

    activation_checkpointing: str = "none"
    """``"none"``; ``"full"``: every repeated block is recomputed in backward (torch's
    non-reentrant ``checkpoint_wrapper`` around each block), keeping only each block's input; or
    ``"selective"``: torchtitan's op-level selective activation checkpointing, with torch's
    ``create_selective_checkpoint_contexts`` as the ``context_fn`` of that wrapper: each block
    keeps its input and the outputs of every other matmul (``aten.mm``/``aten.addmm``, the 1st,
    3rd, ...), of the SDPA attention kernels, of ``aten.max`` and of reduce-scatter, and
    recomputes the rest (norms, activations, rotary embedding, the other matmuls) in backward."""

    rank: int = 0
    """The rank whose memory is measured (FSDP2 pads shards to one size, so ranks agree)."""

    cpu_offload: bool = False
    """FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and the optimizer
    state live in host memory, and the optimizer step runs on the CPU; the device holds the
    gathered parameters, the copies of shards made for each all-gather and of gradients before
    they go back, and the activations. Traced only (on a fake accelerator, in a child process)."""

    def __post_init__(self) -> None:
        _positive_int(self.world_size, "world_size", "8")
        if self.gpus_per_node is not None:
            _positive_int(self.gpus_per_node, "gpus_per_node", "8")
        if self.sharding not in SHARDINGS:
            raise InputError(f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {self.sharding!r}")
        self._check_checkpointing()
        self._check_mesh()
        object.__setattr__(self, "param_dtype", dtype_of(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "reduce_dtype", dtype_of(self.reduce_dtype, "reduce_dtype"))
        mixed = self.param_dtype is not None or self.reduce_dtype is not None
        if mixed and self.sharding not in ("fsdp", "hybrid"):
            raise InputError(
                f"param_dtype/reduce_dtype are FSDP2's mixed-precision policy: use sharding='fsdp' or 'hybrid', "
                f"or leave them None for sharding={self.sharding!r}"
            )
        if not isinstance(self.cpu_offload, bool):
            raise InputTypeError(f"cpu_offload must be True or False, got {self.cpu_offload!r}")
        if self.cpu_offload and self.sharding not in ("fsdp", "hybrid"):
            raise InputError(
                f"cpu_offload is FSDP2's CPUOffloadPolicy: use sharding='fsdp' or 'hybrid' (got {self.sharding!r})"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise InputError(
                f"rank must be an integer from 0 to world_size - 1 = {self.world_size - 1}, got {self.rank!r}"
            )

    def _check_checkpointing(self) -> None:
        if self.activation_checkpointing not in CHECKPOINTING:
            raise InputError(
                "activation_checkpointing must be 'none' or 'full' or 'selective' (torchtitan's op-level policy), "
                f"got {self.activation_checkpointing!r}"
            )

    def _check_mesh(self) -> None:
        if self.sharding == "none" and self.world_size != 1:
            raise InputError(
                f"sharding='none' is one process alone: give world_size=1 (got {self.world_size}), "
                "or sharding='fsdp', 'hybrid' or 'ddp'"
            )
        if self.sharding != "hybrid":
            return
        if self.gpus_per_node is None:
            raise InputError("sharding='hybrid' shards within a node: give gpus_per_node (e.g. 8)")
        if self.world_size % self.gpus_per_node:
            raise InputError(
                f"sharding='hybrid' needs whole nodes: world_size {self.world_size} is not a multiple of "
                f"gpus_per_node {self.gpus_per_node}; give a world_size such as "
                f"{max(1, self.world_size // self.gpus_per_node) * self.gpus_per_node}"
            )

    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh: ``(world_size,)``, or ``(nodes, gpus_per_node)`` (replicate, shard) for hybrid."""
        if self.sharding == "hybrid":
            return (self.world_size // self.gpus_per_node, self.gpus_per_node)
        return (self.world_size,)

    def shard_ranks(self) -> int:
        """Over how many ranks the parameters, gradients and optimizer state are split."""
        return {"fsdp": self.world_size, "hybrid": self.gpus_per_node}.get(self.sharding, 1)

    def to_dict(self) -> dict[str, object]:
        """The settings, JSON-ready (dtypes by name).

        >>> Parallelism(world_size=2, param_dtype="bf16").to_dict()["param_dtype"]
        'bfloat16'
        """
        names = ("world_size", "gpus_per_node", "sharding", "activation_checkpointing", "rank", "cpu_offload")
        plain = {name: getattr(self, name) for name in names}
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            plain[name] = None if value is None else str(value).removeprefix("torch.")
        return plain
