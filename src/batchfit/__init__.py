"""batchfit: what batch size should I train with on this hardware?

>>> import batchfit as bf
>>> bf.SimulatedDevice("8GiB").capacity_bytes()
8589934592
"""

from batchfit.devices import CpuDevice, CudaDevice, Device, MpsDevice, SimulatedDevice, is_oom
from batchfit.search.memory_model import MemoryModel
from batchfit.search.result import NoBatchFitsError, SearchResult
from batchfit.search.runner import find_max_batch_size, probe_batch_size, search
from batchfit.search.strategies import STRATEGIES, SearchSpace, make_strategy
from batchfit.state import StateSnapshot
from batchfit.trial import Trial
from batchfit.units import format_bytes, parse_bytes
from batchfit.workload import Workload

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "MemoryModel",
    "MpsDevice",
    "NoBatchFitsError",
    "SearchResult",
    "SearchSpace",
    "SimulatedDevice",
    "StateSnapshot",
    "Trial",
    "Workload",
    "find_max_batch_size",
    "format_bytes",
    "is_oom",
    "make_strategy",
    "parse_bytes",
    "probe_batch_size",
    "search",
]
