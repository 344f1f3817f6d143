"""The throughput-optimal batch, built on the search: the largest batch that fits bounds a grid of batch sizes,
each timed in steady state (state restored after each), and the smallest batch within a tolerance of the best
samples/s is chosen, with the fitted step time t(B) = alpha + beta*B and its knees (``optimal``), returned as
a ``ThroughputResult`` of ``ThroughputPoint`` s (``result``). Each point keeps the spread of its timed steps, and
the result says when the timings cannot tell the sizes apart (``distinguishable``, ``verdict``); a callback
(``on_point``) hears of each size as it is timed, and ``max_seconds`` bounds the whole of it.

May import ``step``, ``devices``, ``search`` and ``errors``; never ``runtime``, ``sweep``, ``cli`` or
``integrations``. The workflows, the integrations and the CLI import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "checkpointing_frontier": "batchfit.throughput.frontier",
        "frontier_for_workload": "batchfit.throughput.frontier",
        "CheckpointingFrontier": "batchfit.throughput.frontier_result",
        "FrontierChoice": "batchfit.throughput.frontier_result",
        "PolicyFrontier": "batchfit.throughput.frontier_result",
        "check_max_seconds": "batchfit.throughput.optimal",
        "check_maximum": "batchfit.throughput.optimal",
        "find_optimal_batch_size": "batchfit.throughput.optimal",
        "optimal_for_workload": "batchfit.throughput.optimal",
        "ThroughputPoint": "batchfit.throughput.result",
        "ThroughputResult": "batchfit.throughput.result",
    },
)

if TYPE_CHECKING:
    from batchfit.throughput.frontier import checkpointing_frontier
    from batchfit.throughput.frontier import frontier_for_workload
    from batchfit.throughput.frontier_result import CheckpointingFrontier
    from batchfit.throughput.frontier_result import FrontierChoice
    from batchfit.throughput.frontier_result import PolicyFrontier
    from batchfit.throughput.optimal import check_max_seconds
    from batchfit.throughput.optimal import check_maximum
    from batchfit.throughput.optimal import find_optimal_batch_size
    from batchfit.throughput.optimal import optimal_for_workload
    from batchfit.throughput.result import ThroughputPoint
    from batchfit.throughput.result import ThroughputResult

__all__ = [
    "CheckpointingFrontier",
    "FrontierChoice",
    "PolicyFrontier",
    "ThroughputPoint",
    "ThroughputResult",
    "check_max_seconds",
    "check_maximum",
    "checkpointing_frontier",
    "find_optimal_batch_size",
    "frontier_for_workload",
    "optimal_for_workload",
]
