"""The ``batchfit`` command: every subcommand, the console report, plots, workload loading and the
built-in example workloads. The top layer: may import anything; nothing in the core imports it.
"""

from batchfit.cli.app import app  # the faces only: light to import (each command's body loads when it runs)

__all__ = ["app"]
