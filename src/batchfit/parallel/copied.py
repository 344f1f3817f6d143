"""A user's own workload as one rank of N: real trials of its model sharded with FSDP2, while the
user's model and optimizer are never touched.

The model is copied onto ``meta`` (its structure only: no parameter or buffer is copied), sharded
with ``shard_model`` over the fake world, and only this rank's shards are materialised on the
device, filled with this rank's rows of the user's values (and the buffers with the user's
buffers). The optimizer is built again over the shards from the user's optimizer's class, its
defaults and each parameter group's settings. The rest of the workload (sample, loss, AMP, loop)
is the user's, unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.parallel.one_rank import ONE_RANK
from batchfit.parallel.one_rank import RankBackend
from batchfit.parallel.one_rank import annotated
from batchfit.parallel.one_rank import check_real_trials
from batchfit.parallel.one_rank import one_rank_mode
from batchfit.parallel.settings import REAL_OFFLOAD_REFUSAL
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import RankSession
from batchfit.parallel.wrap import shard_model
from batchfit.search.result import SearchResult
from batchfit.step.batching import bytes_per_sample
from batchfit.step.batching import resize_batch
from batchfit.step.compiled import uncompiled
from batchfit.step.workload import Workload
from batchfit.step.workload import autocast
from batchfit.step.workload import call_by_convention
from batchfit.step.workload import loss_of

WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # what torch's checkpoint_wrapper adds to the names inside it


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure with every parameter and buffer on ``meta``: nothing of its data is
    copied, tied parameters stay tied, and ``model`` is not changed.

    >>> copied = meta_copy(torch.nn.Linear(4, 2))
    >>> copied.weight.device.type, copied.weight.shape
    ('meta', torch.Size([2, 4]))
    """
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def plain_name(name: str) -> str:
    """A parameter's name as in the unwrapped model.

    >>> plain_name("layers.0._checkpoint_wrapped_module.mlp.weight")
    'layers.0.mlp.weight'
    """
    return name.replace(WRAPPER_PREFIX, "")


def _local_rows(source: torch.Tensor, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(local tensor, the user's rows for it)`` of a sharded parameter: FSDP2 splits dim 0 as
    ``torch.chunk`` does over the mesh's last (shard) dimension; ``None`` for a rank without rows."""
    local = param.to_local() if hasattr(param, "to_local") else param
    if not hasattr(param, "device_mesh"):
        return local, source
    mesh = param.device_mesh
    index, count = mesh.get_coordinate()[-1], mesh.size(mesh.ndim - 1)
    chunks = torch.chunk(source.detach(), count, dim=0)
    if index >= len(chunks) or local.numel() == 0:
        return None
    return local, chunks[index]


@torch.no_grad()
def fill_from(sharded: nn.Module, original: nn.Module) -> None:
    """Give ``sharded``'s local shards this rank's rows of ``original``'s parameters, and its
    buffers ``original``'s buffers."""
    params = dict(original.named_parameters())
    for name, param in sharded.named_parameters():
        pair = _local_rows(params[plain_name(name)], param)
        if pair is not None:
            pair[0].copy_(pair[1].reshape(pair[0].shape))
    buffers = dict(original.named_buffers())
    for name, buffer in sharded.named_buffers():
        buffer.copy_(buffers[plain_name(name)])


def rebuilt_optimizer(optimizer: torch.optim.Optimizer | None, original: nn.Module, sharded: nn.Module) -> Any:
    """A new optimizer of ``optimizer``'s class over ``sharded``'s parameters, with its defaults and
    each group's settings; ``optimizer`` and its state are not touched."""
    if optimizer is None:
        return None
    name_of = {id(param): name for name, param in original.named_parameters()}
    shards = {plain_name(name): param for name, param in sharded.named_parameters()}
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [shards[name_of[id(p)]] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    accepted = inspect.signature(type(optimizer)).parameters  # defaults may hold settings the class sets itself
    return type(optimizer)(groups, **{key: value for key, value in optimizer.defaults.items() if key in accepted})


@dataclass(frozen=True)
class ShardedCopy:
    """``workload`` trained as rank ``parallelism.rank`` of ``parallelism.world_size`` under FSDP2,
    for real trials over torch's fake process group (see the module).

    >>> work = Workload(torch.nn.Linear(8, 8), torch.randn(4, 8), loss_fn=lambda out, batch: out.mean())
    >>> ShardedCopy(work, Parallelism(world_size=8)).mode()
    'one rank of 8, real trials; collectives not run, NCCL buffers not counted'
    """

    workload: Workload
    parallelism: Parallelism

    def __post_init__(self) -> None:
        if not isinstance(self.workload, Workload):
            raise InputTypeError(f"one-rank trials shard a batchfit Workload, got {type(self.workload).__name__}")
        check_real_trials(self.parallelism)
        object.__setattr__(self, "workload", uncompiled(self.workload))  # FSDP2 shards the module itself

    @property
    def name(self) -> str:
        return self.workload.name

    @property
    def model(self) -> nn.Module:
        """The user's model (copied, never changed)."""
        return self.workload.model

    def mode(self, traced: bool = False) -> str:
        return one_rank_mode(self.parallelism, traced)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.workload.model.parameters())

    def bytes_per_sample(self) -> int:
        return bytes_per_sample(self.workload.sample_batch)

    def build(self, mesh: Any, device: torch.device) -> Workload:
        """The rank's step: the model's copy sharded over ``mesh`` with this rank's values on
        ``device``, the optimizer built again over it, the rest of the workload as it is."""
        original = self.workload.model
        sharded = shard_model(meta_copy(original), mesh, self.parallelism)
        sharded.to_empty(device=device)
        fill_from(sharded, original)
        optimizer = rebuilt_optimizer(self.workload.optimizer, original, sharded)
        return dataclasses.replace(self.workload, model=sharded, optimizer=optimizer)

    def annotated(self, result: SearchResult, device: Any) -> SearchResult:
        """The search's result naming what its trials were (see ``one_rank.annotated``)."""
        return annotated(self, result, device)

    def session(self, steps: int = 2) -> WorkloadSession:
        """A ``RankSession`` tracing this rank on fake tensors at several micro-batch sizes."""
        return WorkloadSession(self.workload, parallelism=self.parallelism, steps=steps)

    def backend(self) -> RankBackend:
        return ONE_RANK


class WorkloadSession(RankSession):
    """A ``RankSession`` over a user's own ``Workload``: its model copied onto ``meta`` and sharded,
    fake shards (real ones with ``fake=False``, holding the rank's rows of the model's values), the
    optimizer built again, batches built from its sample, and its loss by its calling convention
    (``loss_fn``, ``step_fn``, AMP, ``keep_output``).

    >>> work = Workload(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)), torch.randn(4, 8),
    ...                 loss_fn=lambda out, batch: out.pow(2).mean(), optimizer=lambda p: torch.optim.AdamW(p))
    >>> with WorkloadSession(work, parallelism=Parallelism(world_size=2)) as session:
    ...     estimate = session.trace(16)
    >>> estimate.batch_size, estimate.world_size, estimate.peak_bytes > 0
    (16, 2, True)
    """

    builds_on_accelerator = False  # the copy is made on the CPU, whatever the process has

    def __init__(
        self, workload: Workload, *, parallelism: Parallelism | None = None, steps: int = 2, fake: bool = True
    ):
        if workload.optimizer is None:
            raise InputError("a sharded trace runs the optimizer step: give the Workload an optimizer")
        if parallelism is not None and parallelism.cpu_offload:
            raise InputError(REAL_OFFLOAD_REFUSAL)
        super().__init__(lambda: workload.model, 1, parallelism=parallelism, steps=steps, fake=fake)
        self.workload, self.seq_len = workload, 0

    def _sharded(self, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        original = self.workload.model
        model = shard_model(meta_copy(original), mesh, self.parallelism)
        model.to_empty(device="cpu")
        if not self.fake:
            fill_from(model, original)
        return model, rebuilt_optimizer(self.workload.optimizer, original, model)

    def _batch(self, batch_size: int) -> Any:
        return resize_batch(self.workload.sample_batch, batch_size)

    def _checks(self, batch_size: int) -> Any:
        return contextlib.nullcontext()

    def _forward(self, model: nn.Module, batch: Any) -> tuple[Any, Any]:
        work = self.workload
        with autocast("cpu", work.amp_dtype):
            if work.step_fn is not None:
                return None, work.step_fn(model, batch)
            output, targets = call_by_convention(model, batch)
            loss = loss_of(output, targets, batch, loss_fn=work.loss_fn)
        return (output if work.keep_output else None), loss
