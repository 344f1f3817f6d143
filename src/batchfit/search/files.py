"""Deprecated alias: atomic file writes are the shared leaf ``batchfit.files`` now (this name goes in the next
release).

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from batchfit.search.files import atomic_write_text
>>> atomic_write_text.__module__, caught[0].category.__name__
('batchfit.files', 'DeprecationWarning')
"""

from __future__ import annotations

import warnings
from typing import Any

from batchfit import files


def __getattr__(name: str) -> Any:
    if name.startswith("_") or not hasattr(files, name):  # tools probing the module: no warning
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"batchfit.search.files.{name} moved to batchfit.files.{name}", DeprecationWarning, stacklevel=2)
    return getattr(files, name)
