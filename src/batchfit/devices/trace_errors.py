"""What stops a trace, and whose it is: the errors fake tensors raise for what they cannot do
(``fake_tensor_errors()``) and the source files only fake tensors or batchfit's trace run through,
sorted from the user's own ``ValueError``/``TypeError`` (``is_users_error``, raised unchanged: the
real device would raise it too); ``trace_error`` and ``tracing`` turn the rest into a one-line
``TraceError`` that says to fall back to real probing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch._subclasses import fake_tensor

from batchfit.errors import NoBatchFitsError
from batchfit.errors import TraceError

# What fake tensors raise for what they cannot do (all RuntimeErrors in torch 2.x).
FAKE_TENSOR_ERRORS = (
    fake_tensor.DataDependentOutputException,  # .item(), .tolist(), bool(t), torch.equal, ...
    fake_tensor.DynamicOutputShapeException,  # torch.nonzero, masked indexing, torch.unique, ...
    fake_tensor.UnsupportedOperatorException,  # an op without a fake kernel
    fake_tensor.UnsupportedFakeTensorException,
)
# Symbolic shapes' guard error joins them once torch has imported that module (only then can it be raised):
# importing it here would load sympy with ``import batchfit``, 1.6 s for one exception class.
SYMBOLIC_SHAPES = "torch.fx.experimental.symbolic_shapes"


def fake_tensor_errors() -> tuple[type[BaseException], ...]:
    """What fake tensors raise for what they cannot do, ``GuardOnDataDependentSymNode`` included where
    symbolic shapes are loaded."""
    shapes = sys.modules.get(SYMBOLIC_SHAPES)
    guard = getattr(shapes, "GuardOnDataDependentSymNode", None)
    return FAKE_TENSOR_ERRORS if guard is None else (*FAKE_TENSOR_ERRORS, guard)


# Source files only fake tensors run through: an error raised in them is the trace's.
FAKE_TENSOR_SOURCES = (
    "torch/_subclasses/",
    "torch/_meta_registrations.py",
    "torch/_refs/",
    "torch/_prims/",
    "torch/_prims_common/",
    "torch/_decomp/",
    "torch/fx/experimental/",
)
# batchfit's own trace-only modules: an error raised there is batchfit's, never the user's.
TRACE_SOURCES = (
    "batchfit/devices/trace.py",
    "batchfit/devices/trace_errors.py",
    "batchfit/devices/undercounts.py",
    "batchfit/devices/fake_values.py",
    "batchfit/devices/value_rules.py",
    "batchfit/devices/accounting.py",
    "batchfit/search/estimate.py",
)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _raised_by_fakes(error: BaseException) -> bool:
    """Whether ``error`` comes from fake tensors or from batchfit's trace, not from the user's code."""
    if isinstance(error, (TraceError, *fake_tensor_errors())):
        return True
    message = str(error).lower()
    if "faketensor" in message or "fake tensor" in message:  # e.g. f"{loss:.3f}" on a fake scalar
        return True
    frames = list(_source_files(error.__traceback__))
    if any(part in name for name in frames for part in FAKE_TENSOR_SOURCES):
        return True
    return bool(frames) and frames[-1].endswith(TRACE_SOURCES)


def _source_files(traceback: Any) -> Iterator[str]:
    """The file of every frame of ``traceback``, outermost first, with ``/`` separators."""
    while traceback is not None:
        yield traceback.tb_frame.f_code.co_filename.replace("\\", "/")
        traceback = traceback.tb_next


def is_users_error(error: BaseException) -> bool:
    """Whether ``error``, raised while a step ran on fake tensors, is the user's own mistake: a
    ``ValueError``/``TypeError`` their model, loss or step raised, which the real device would
    raise too. Not the user's: a ``TraceError``, what fake tensors raise (data-dependent
    values or shapes, ops without a fake kernel, see ``fake_tensor_errors()``) or an error raised
    inside torch's fake-tensor code or batchfit's trace, also when the user's code re-raised it.

    >>> is_users_error(ValueError("bad targets")), is_users_error(TraceError("no fake kernel"))
    (True, False)
    """
    if not isinstance(error, (ValueError, TypeError)) or isinstance(error, NoBatchFitsError):
        return False
    return not any(_raised_by_fakes(link) for link in _chain(error))


def trace_error(error: BaseException) -> TraceError:
    """A one-line ``TraceError`` saying which error stopped the trace and what to do instead."""
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    return TraceError(
        f"cannot trace this workload on fake tensors ({type(error).__name__}: {reason}); "
        "measure it with `batchfit find` on a real or simulated device instead"
    )


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Turn what fake tensors cannot do into a ``TraceError`` that says why; the user's own
    ``ValueError``/``TypeError`` (see ``is_users_error``), a ``TraceError``, ``NoBatchFitsError``
    and ``KeyboardInterrupt`` pass unchanged."""
    try:
        yield
    except Exception as error:
        if isinstance(error, (TraceError, NoBatchFitsError)) or is_users_error(error):
            raise
        raise trace_error(error) from error
