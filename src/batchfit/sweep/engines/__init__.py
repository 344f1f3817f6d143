"""The engines a sweep fans out on: ``local`` (a fresh process per configuration on this node's slots),
``slurm`` (submitit job arrays), ``ray`` (tasks on a Ray cluster); ``inline`` is the sequential sweep in this
process. ``make_engine`` builds one from ``EngineOptions``; an engine whose extra is not installed is one
``InputError`` naming the extra. The engines' own modules import ``batchfit.sweep.engines.options``."""

from batchfit.sweep.engines.options import ENGINES
from batchfit.sweep.engines.options import EXTRAS
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.options import check_engine
from batchfit.sweep.engines.registry import make_engine

__all__ = ["ENGINES", "EXTRAS", "EngineOptions", "check_engine", "make_engine"]
