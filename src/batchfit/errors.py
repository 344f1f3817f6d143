"""Every public exception batchfit raises on purpose. Imports nothing from batchfit but type hints.

Bad input is an ``InputError`` (a ``ValueError``; ``InputTypeError`` is also a ``TypeError``) whose
one-line message names the fix: the one class the command line prints as a user's mistake. Any
other exception is a bug (batchfit's, or the workload code's) and keeps its traceback. The rest
are outcomes a caller may want to catch by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchfit.search.trial import Trial


class InputError(ValueError):
    """Bad input the caller can fix; the message says how. A ``ValueError``, so ``except
    ValueError`` keeps working."""


class InputTypeError(InputError, TypeError):
    """Input of the wrong type; also a ``TypeError``."""


class NoBatchFitsError(RuntimeError):
    """Even ``min_batch_size`` does not fit; ``.trials`` holds what was tried."""

    def __init__(self, message: str, trials: list[Trial]):
        super().__init__(message)
        self.trials = trials


class ModelDoesNotFitError(NoBatchFitsError, ValueError):
    """The workload's state alone (parameters, buffers, optimizer state) fills the usable memory."""

    def __init__(self, message: str):
        super().__init__(message, [])


class TraceError(InputError):
    """The workload cannot run on fake tensors (an op without a fake kernel, data-dependent
    shapes, a model that cannot be copied, ...)."""


__all__ = ["InputError", "InputTypeError", "ModelDoesNotFitError", "NoBatchFitsError", "TraceError"]
