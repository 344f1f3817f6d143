"""batchfit: what batch size should I train with on this hardware?

>>> import batchfit as bf
>>> bf.SimulatedDevice("8GiB").capacity_bytes()
8589934592
"""

from batchfit.accumulate import GradientAccumulator
from batchfit.cache import ResultCache
from batchfit.critical import critical_batch_by_training
from batchfit.decorator import executable_batch_size
from batchfit.devices import CpuDevice
from batchfit.devices import CudaDevice
from batchfit.devices import Device
from batchfit.devices import MpsDevice
from batchfit.devices import SimulatedDevice
from batchfit.devices import is_oom
from batchfit.devices.presets import ACCELERATORS
from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import TraceError
from batchfit.estimate import AnalyticEstimate
from batchfit.estimate import MemoryEstimate
from batchfit.estimate import analytic_estimate
from batchfit.estimate import estimate_memory
from batchfit.microbatch import EvalMicrobatcher
from batchfit.microbatch import Microbatcher
from batchfit.noise import NoiseScale
from batchfit.noise import NoiseScaleEstimator
from batchfit.noise import goodput
from batchfit.noise_measure import measure_noise_scale
from batchfit.plan import BatchPlan
from batchfit.plan import plan_batch
from batchfit.rules import ScaleRules
from batchfit.search.memory_model import MemoryModel
from batchfit.search.result import ModelDoesNotFitError
from batchfit.search.result import NoBatchFitsError
from batchfit.search.result import SearchResult
from batchfit.search.runner import find_max_batch_size
from batchfit.search.runner import probe_batch_size
from batchfit.search.runner import search
from batchfit.search.strategies import STRATEGIES
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import make_strategy
from batchfit.state import StateSnapshot
from batchfit.sweep import sweep
from batchfit.sweep_file import SweepResult
from batchfit.throughput import ThroughputResult
from batchfit.throughput import find_optimal_batch_size
from batchfit.trial import Trial
from batchfit.units import format_bytes
from batchfit.units import parse_bytes
from batchfit.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "ACCELERATORS",
    "STRATEGIES",
    "AnalyticEstimate",
    "BatchPlan",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "EvalMicrobatcher",
    "GradientAccumulator",
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
    "SearchSpace",
    "SimulatedDevice",
    "StateSnapshot",
    "SweepResult",
    "ThroughputResult",
    "TraceDevice",
    "TraceError",
    "Trial",
    "Workload",
    "analytic_estimate",
    "critical_batch_by_training",
    "estimate_memory",
    "executable_batch_size",
    "find_max_batch_size",
    "find_optimal_batch_size",
    "format_bytes",
    "goodput",
    "is_oom",
    "make_strategy",
    "measure_noise_scale",
    "parse_bytes",
    "plan_batch",
    "probe_batch_size",
    "search",
    "sweep",
]
