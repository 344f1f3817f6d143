"""Deprecated alias: the throughput-optimal batch is the ``batchfit.throughput`` layer now (this name goes in the
next release).

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from batchfit.search.throughput import ThroughputResult
>>> ThroughputResult.__module__, caught[0].category.__name__
('batchfit.throughput.result', 'DeprecationWarning')
"""

from __future__ import annotations

import warnings
from typing import Any

import batchfit.throughput as moved
from batchfit.throughput import optimal


def __getattr__(name: str) -> Any:
    if name.startswith("_") or not hasattr(optimal, name):  # tools probing the module: no warning
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    home = moved.__name__ if name in moved.__all__ else optimal.__name__
    warnings.warn(f"batchfit.search.throughput.{name} moved to {home}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(optimal, name)
