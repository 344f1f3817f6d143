"""torch.compile'd models on the counting devices (simulated, trace, CPU).

Those devices count bytes through a ``TorchDispatchMode``. Dynamo does not compile under an active
dispatch mode, and worse: a compiled module called under one has its ``forward`` code marked
"skip" for the rest of the process, so the user's model would never compile again (torch 2.13;
any plain ``TorchDispatchMode`` shows it). There, a compiled model is probed as its original
module, which shares the parameters: the memory of the eager step, and the model left compilable.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger("batchfit")


def uncompiled(workload: Any) -> Any:
    """``workload`` with a compiled model replaced by its original module (``CountingDevice.prepare``)."""
    original = getattr(workload.model, "_orig_mod", None)
    if original is None:
        return workload
    logger.info("batchfit: probing the torch.compile'd model's original module (eager memory)")
    return dataclasses.replace(workload, model=original)
