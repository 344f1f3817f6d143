"""The package's version and the versions a result records, so files written today can be read tomorrow."""

from __future__ import annotations

import platform
import sys

__version__ = "0.1.0"


def versions() -> dict[str, str]:
    """The versions that decide a measurement: batchfit, torch, Python and the platform.

    >>> sorted(versions())
    ['batchfit', 'platform', 'python', 'torch']
    """
    import torch

    return {
        "batchfit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": sys.platform,
    }
