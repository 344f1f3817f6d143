"""``make_engine``: an engine by its name, imported only when it is asked for (Ray and submitit are extras)."""

from __future__ import annotations

from batchfit.errors import InputError
from batchfit.sweep.engines.base import Engine
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.options import check_engine


def make_engine(name: str, options: EngineOptions, device: str) -> Engine:
    """The engine ``name`` (not ``inline``, which is no engine), set up from ``options`` for ``device``."""
    check_engine(name)
    if name == "local":
        from batchfit.sweep.engines.local import LocalEngine

        return LocalEngine.make(options, device)
    if name == "slurm":
        from batchfit.sweep.engines.slurm import SlurmEngine

        return SlurmEngine.make(options, device)
    if name == "ray":
        from batchfit.sweep.engines.ray import RayEngine

        return RayEngine.make(options, device)
    raise InputError(f"the {name} engine runs in this process: it is no engine to make")
