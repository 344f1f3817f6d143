"""Deprecated alias: the built-in workloads are ``batchfit.step.builtin_workloads`` (this name goes in the next
release).

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from batchfit.cli.examples import gpt_tiny
>>> gpt_tiny.__module__, caught[0].category.__name__
('batchfit.step.builtin_workloads', 'DeprecationWarning')
"""

from __future__ import annotations

import warnings
from typing import Any

from batchfit.step import builtin_workloads


def __getattr__(name: str) -> Any:
    if name.startswith("_") or not hasattr(builtin_workloads, name):  # tools probing the module: no warning
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"batchfit.cli.examples.{name} moved to batchfit.step.builtin_workloads.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(builtin_workloads, name)
