"""batchfit: what batch size should I train with on this hardware?

>>> import batchfit as bf
>>> bf.SimulatedDevice("8GiB").capacity_bytes()
8589934592
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_names
from batchfit._version import __version__
from batchfit._version import versions

# Each public name and the module that holds it, imported on first use (``batchfit._lazy``): ``import batchfit``
# and the command line's help load no torch; ``bf.SimulatedDevice`` imports what it needs the first time it is read.
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "CpuDevice": "batchfit.devices",
        "CudaDevice": "batchfit.devices",
        "Device": "batchfit.devices",
        "MpsDevice": "batchfit.devices",
        "SimulatedDevice": "batchfit.devices",
        "is_oom": "batchfit.devices",
        "ACCELERATORS": "batchfit.devices.presets",
        "TraceDevice": "batchfit.devices.trace",
        "format_bytes": "batchfit.devices.units",
        "parse_bytes": "batchfit.devices.units",
        "InputError": "batchfit.errors",
        "InputTypeError": "batchfit.errors",
        "ModelDoesNotFitError": "batchfit.errors",
        "NoBatchFitsError": "batchfit.errors",
        "TraceError": "batchfit.errors",
        "NoiseScale": "batchfit.planning.noise",
        "NoiseScaleEstimator": "batchfit.planning.noise",
        "goodput": "batchfit.planning.noise",
        "BatchPlan": "batchfit.planning.plan",
        "plan_batch": "batchfit.planning.plan",
        "GradientAccumulator": "batchfit.runtime.accumulate",
        "critical_batch_by_training": "batchfit.runtime.critical",
        "executable_batch_size": "batchfit.runtime.decorator",
        "EvalMicrobatcher": "batchfit.runtime.evaluation",
        "Microbatcher": "batchfit.runtime.microbatch",
        "measure_noise_scale": "batchfit.runtime.noise_measure",
        "ResultCache": "batchfit.search.cache",
        "AnalyticEstimate": "batchfit.search.estimate",
        "MemoryEstimate": "batchfit.search.estimate",
        "analytic_estimate": "batchfit.search.estimate",
        "estimate_memory": "batchfit.search.estimate",
        "MemoryModel": "batchfit.search.memory_model",
        "SearchResult": "batchfit.search.result",
        "search_workload": "batchfit.search.runner",
        "SearchSettings": "batchfit.search.settings",
        "STRATEGIES": "batchfit.search.strategies",
        "SearchSpace": "batchfit.search.strategies",
        "make_strategy": "batchfit.search.strategies",
        "Trial": "batchfit.search.trial",
        "StateSnapshot": "batchfit.step.state",
        "Workload": "batchfit.step.workload",
        "sweep_grid": "batchfit.sweep.api",
        "SweepResult": "batchfit.sweep.results",
        "ScaleRules": "batchfit.sweep.rules",
        "CheckpointingFrontier": "batchfit.throughput",
        "ThroughputResult": "batchfit.throughput",
        "checkpointing_frontier": "batchfit.throughput",
        "find_optimal_batch_size": "batchfit.throughput",
        "find_token_budget": "batchfit.tokens.budget",
        "TokenBudget": "batchfit.tokens.result",
        "find_max_batch_size": "batchfit.workflows.find",
        "probe_batch_size": "batchfit.workflows.find",
    },
)

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported for real
    from batchfit.devices import CpuDevice
    from batchfit.devices import CudaDevice
    from batchfit.devices import Device
    from batchfit.devices import MpsDevice
    from batchfit.devices import SimulatedDevice
    from batchfit.devices import is_oom
    from batchfit.devices.presets import ACCELERATORS
    from batchfit.devices.trace import TraceDevice
    from batchfit.devices.units import format_bytes
    from batchfit.devices.units import parse_bytes
    from batchfit.errors import InputError
    from batchfit.errors import InputTypeError
    from batchfit.errors import ModelDoesNotFitError
    from batchfit.errors import NoBatchFitsError
    from batchfit.errors import TraceError
    from batchfit.planning.noise import NoiseScale
    from batchfit.planning.noise import NoiseScaleEstimator
    from batchfit.planning.noise import goodput
    from batchfit.planning.plan import BatchPlan
    from batchfit.planning.plan import plan_batch
    from batchfit.runtime.accumulate import GradientAccumulator
    from batchfit.runtime.critical import critical_batch_by_training
    from batchfit.runtime.decorator import executable_batch_size
    from batchfit.runtime.evaluation import EvalMicrobatcher
    from batchfit.runtime.microbatch import Microbatcher
    from batchfit.runtime.noise_measure import measure_noise_scale
    from batchfit.search.cache import ResultCache
    from batchfit.search.estimate import AnalyticEstimate
    from batchfit.search.estimate import MemoryEstimate
    from batchfit.search.estimate import analytic_estimate
    from batchfit.search.estimate import estimate_memory
    from batchfit.search.memory_model import MemoryModel
    from batchfit.search.result import SearchResult
    from batchfit.search.runner import search_workload
    from batchfit.search.settings import SearchSettings
    from batchfit.search.strategies import STRATEGIES
    from batchfit.search.strategies import SearchSpace
    from batchfit.search.strategies import make_strategy
    from batchfit.search.trial import Trial
    from batchfit.step.state import StateSnapshot
    from batchfit.step.workload import Workload
    from batchfit.sweep.api import sweep_grid
    from batchfit.sweep.results import SweepResult
    from batchfit.sweep.rules import ScaleRules
    from batchfit.throughput import CheckpointingFrontier
    from batchfit.throughput import ThroughputResult
    from batchfit.throughput import checkpointing_frontier
    from batchfit.throughput import find_optimal_batch_size
    from batchfit.tokens.budget import find_token_budget
    from batchfit.tokens.result import TokenBudget
    from batchfit.workflows.find import find_max_batch_size
    from batchfit.workflows.find import probe_batch_size

__all__ = [
    "ACCELERATORS",
    "STRATEGIES",
    "AnalyticEstimate",
    "BatchPlan",
    "CheckpointingFrontier",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "EvalMicrobatcher",
    "GradientAccumulator",
    "InputError",
    "InputTypeError",
    "MemoryEstimate",
    "MemoryModel",
    "Microbatcher",
    "ModelDoesNotFitError",
    "MpsDevice",
    "NoBatchFitsError",
    "NoiseScale",
    "NoiseScaleEstimator",
    "ResultCache",
    "ScaleRules",
    "SearchResult",
    "SearchSettings",
    "SearchSpace",
    "SimulatedDevice",
    "StateSnapshot",
    "SweepResult",
    "ThroughputResult",
    "TokenBudget",
    "TraceDevice",
    "TraceError",
    "Trial",
    "Workload",
    "__version__",
    "analytic_estimate",
    "checkpointing_frontier",
    "critical_batch_by_training",
    "estimate_memory",
    "executable_batch_size",
    "find_max_batch_size",
    "find_optimal_batch_size",
    "find_token_budget",
    "format_bytes",
    "goodput",
    "is_oom",
    "make_strategy",
    "measure_noise_scale",
    "parse_bytes",
    "plan_batch",
    "probe_batch_size",
    "search_workload",
    "sweep_grid",
    "versions",
]
