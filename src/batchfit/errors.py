"""Every public exception batchfit raises on purpose. Imports nothing from batchfit but type hints.

Bad input is a plain ``ValueError``/``TypeError`` naming the fix; these are the outcomes a caller
may want to catch by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchfit.search.trial import Trial


class NoBatchFitsError(RuntimeError):
    """Even ``min_batch_size`` does not fit; ``.trials`` holds what was tried."""

    def __init__(self, message: str, trials: list[Trial]):
        super().__init__(message)
        self.trials = trials


class ModelDoesNotFitError(NoBatchFitsError, ValueError):
    """The workload's state alone (parameters, buffers, optimizer state) fills the usable memory."""

    def __init__(self, message: str):
        super().__init__(message, [])


class TraceError(ValueError):
    """The workload cannot run on fake tensors (an op without a fake kernel, data-dependent
    shapes, a model that cannot be copied, ...)."""


__all__ = ["ModelDoesNotFitError", "NoBatchFitsError", "TraceError"]
