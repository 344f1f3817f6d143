"""Collected before everything: doctests of optional integrations only where their framework is installed, and the
terminal width left to each test under pytest-xdist."""

import importlib.util
import os

OPTIONAL = {
    "integrations/lightning.py": "lightning",
    "integrations/transformers.py": "transformers",
    "integrations/mlx": "mlx",
    "sweep/engines/slurm.py": "submitit",
    "sweep/engines/ray.py": "ray",
}

collect_ignore = [
    f"src/batchfit/{module}" for module, package in OPTIONAL.items() if importlib.util.find_spec(package) is None
]

# pytest-xdist sets COLUMNS=80 in its workers, and rich fixes a console's width from COLUMNS when the console is
# made (when batchfit.cli is imported, here while collecting doctests). Without it the width is read per call, so
# each CLI test's own COLUMNS decides the wrapping, as in a serial run.
os.environ.pop("COLUMNS", None)
