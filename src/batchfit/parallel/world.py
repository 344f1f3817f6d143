"""A fake world: torch's fake process group of any size and its device mesh, in this one process.

Collectives on the fake process group return at once and move no data, so FSDP2 runs as one rank
of ``world_size`` would, on fake tensors (nothing allocated) or real ones (one rank's memory, with
garbage in the gathered values). The mesh must exist before any ``FakeTensorMode`` is entered:
made inside one, its rank tensors are fake and FSDP2 cannot use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh

from batchfit.errors import InputError
from batchfit.parallel.settings import Parallelism

MESH_NAMES = {1: ("shard",), 2: ("replicate", "shard")}


@contextlib.contextmanager
def fake_world(parallelism: Parallelism, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """Start torch's fake process group as ``parallelism.rank`` of ``parallelism.world_size`` and
    yield its device mesh on ``device_type`` (1-D, or 2-D (replicate, shard) for hybrid sharding). The group is
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
    backend = "fake" if device_type == "cpu" else f"cpu:fake,{device_type}:fake"  # the host's collectives too
    dist.init_process_group(backend, store=store, rank=parallelism.rank, world_size=parallelism.world_size)
    try:
        shape = parallelism.mesh_shape()
        yield init_device_mesh(device_type, shape, mesh_dim_names=MESH_NAMES[len(shape)])
    finally:
        dist.destroy_process_group()
