"""A fake world: torch's fake process group of any size and its device mesh, in this one process.

Collectives on the fake process group return at once and move no data, so FSDP2 runs as one rank
of ``world_size`` would, on fake tensors (nothing allocated) or real ones (one rank's memory, with
garbage in the gathered values). The mesh must exist before any ``FakeTensorMode`` is entered:
made inside one, its rank tensors are fake and FSDP2 cannot use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.errors import InputError
from batchfit.parallel.settings import Parallelism

MESH_NAMES = {1: ("shard",), 2: ("replicate", "shard")}


@contextlib.contextmanager
def fake_world(parallelism: Parallelism, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """Start torch's fake process group as ``parallelism.rank`` of ``parallelism.world_size`` and
    yield its device mesh (1-D, or 2-D (replicate, shard) for hybrid sharding). The group is
    destroyed on the way out, also after an error. Refused when a process group already exists
    (a ``torchrun`` job, or a world not yet closed): this one would replace it.

    >>> with fake_world(Parallelism(world_size=4)) as mesh:
    ...     mesh.size(), dist.get_world_size()
    (4, 4)
    >>> dist.is_initialized()
    False
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_available() and dist.is_initialized():
        raise InputError(
            "a process group is already initialised here: estimate outside torchrun, or call "
            "torch.distributed.destroy_process_group() first"
        )
    store = FakeStore()
    dist.init_process_group("fake", store=store, rank=parallelism.rank, world_size=parallelism.world_size)
    try:
        shape = parallelism.mesh_shape()
        yield init_device_mesh(device_type, shape, mesh_dim_names=MESH_NAMES[len(shape)])
    finally:
        dist.destroy_process_group()


class FilledCollectives(TorchDispatchMode):
    """While active, the fake process group's all-gathers and reduce-scatters leave finite values
    where they would leave whatever memory held: each all-gather's output holds this rank's input
    in every rank's slice (as if every rank held the same shard), each reduce-scatter's output
    this rank's chunk of its input (an average over ranks with the same gradients). That costs a
    copy into buffers that exist anyway (no memory), and keeps value checks in a user's step
    (``clip_grad_norm_(error_if_nonfinite=True)``, a ``GradScaler`` skipping steps on inf) from
    reacting to garbage. Values still are not the real run's: data-dependent routing sees this
    rank's rows repeated, not the model.

    >>> import torch
    >>> with fake_world(Parallelism(world_size=2)), FilledCollectives():
    ...     gathered = torch.full((4,), float("nan"))
    ...     _ = dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0]))
    >>> gathered.tolist()
    [1.0, 2.0, 1.0, 2.0]
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.c10d._allgather_base_.default:
            _repeat_into(args[0].view(-1, args[1].numel()), args[1].reshape(-1))
        elif func is torch.ops.c10d._reduce_scatter_base_.default:
            output, chunk = args[0], args[1].reshape(-1, args[0].numel())[0]
            if not _overlap(output, chunk):
                output.copy_(chunk.view_as(output))
        return result


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def _repeat_into(rows: torch.Tensor, local: torch.Tensor) -> None:
    """Every row of ``rows`` set to ``local``, which may itself be one of them (FSDP2 gathers in
    place): the first row, then doubling copies between rows that do not overlap."""
    if rows[0].data_ptr() != local.data_ptr():
        rows[0].copy_(local)
    filled = 1
    while filled < rows.shape[0]:
        step = min(filled, rows.shape[0] - filled)
        rows[filled : filled + step].copy_(rows[:step])
        filled += step
