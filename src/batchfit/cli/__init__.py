"""The ``batchfit`` command: every subcommand, the console report, plots, workload loading and the
built-in example workloads. The top layer: may import anything; nothing in the core imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {"app": "batchfit.cli.app"})  # importing the package loads no command

if TYPE_CHECKING:
    from batchfit.cli.app import app

__all__ = ["app"]
