"""torch.compile'd models: probed as their original module on counting devices, compiled elsewhere.

Counting devices (simulated, trace, CPU) count bytes through a ``TorchDispatchMode``. Dynamo does
not compile under an active dispatch mode, and worse: a compiled module called under one has its
``forward`` code marked "skip" for the rest of the process, so the user's model would never
compile again (torch 2.13; any plain ``TorchDispatchMode`` shows it). There, a compiled model is
probed as its original module, which shares the parameters: the memory of the eager step, and
the model left compilable.

On a device that reads an allocator (CUDA), the compiled model itself is probed, since its
memory is what training will use. Each trial's batch has its batch dimension marked dynamic
(``torch._dynamo.maybe_mark_dynamic``), so one graph serves every size instead of a recompile per
size; ``CompileWatch`` counts the graphs dynamo compiled during the search (its ``counters``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from batchfit.step.batching import tensor_leaves

logger = logging.getLogger("batchfit")


def is_compiled(model: Any) -> bool:
    """Whether ``model`` is what ``torch.compile(module)`` returned (an ``OptimizedModule``)."""
    return getattr(model, "_orig_mod", None) is not None


def uncompiled(workload: Any) -> Any:
    """``workload`` with a compiled model replaced by its original module (``CountingDevice.prepare``)."""
    if not is_compiled(workload.model):
        return workload
    logger.info("batchfit: probing the torch.compile'd model's original module (eager memory)")
    return dataclasses.replace(workload, model=workload.model._orig_mod)


def runnable(model: Any, device: Any) -> Any:
    """What to call on ``device``: a compiled model's original module where bytes are counted
    through a dispatch mode (a simulated device), else ``model`` itself."""
    return model._orig_mod if getattr(device, "simulated", False) and is_compiled(model) else model


def mark_batch_dynamic(batch: Any) -> None:
    """Mark dimension 0 of every tensor in ``batch`` dynamic, so a new batch size is no new graph."""
    for tensor in tensor_leaves(batch):
        if tensor.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileWatch:
    """Counts the graphs dynamo compiles while a compiled model is probed.

    >>> watch = CompileWatch()
    >>> watch.report(sizes=3)
    {'graphs': 0, 'recompiles': 0, 'sizes': 3}
    """

    def __init__(self) -> None:
        self._start = graphs_compiled()

    def graphs(self) -> int:
        return graphs_compiled() - self._start

    def report(self, sizes: int) -> dict[str, int]:
        """Graphs compiled, recompiles (graphs past the first) and batch sizes probed."""
        graphs = self.graphs()
        return {"graphs": graphs, "recompiles": max(graphs - 1, 0), "sizes": sizes}


def recompile_warning(report: dict[str, int]) -> str | None:
    """A warning when the compile settings made dynamo recompile for the sizes probed, else ``None``."""
    if report["recompiles"] <= 1:
        return None
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8)
    fallback = ""
    if report["graphs"] >= limit:
        fallback = f"; past {limit} graphs dynamo runs the model eagerly, so later trials measured eager memory"
    return (
        f"torch.compile recompiled {report['recompiles']} times for {report['sizes']} batch sizes, although "
        "batchfit marks the batch dimension dynamic: something specializes on it (a Python loop over the "
        f"batch, a size-dependent branch, mark_static, or mode='reduce-overhead' CUDA graphs){fallback}"
    )
