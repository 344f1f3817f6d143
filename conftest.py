"""Doctests of optional integrations are collected only where their framework is installed."""

import importlib.util

OPTIONAL = {"lightning.py": "lightning", "transformers.py": "transformers", "mlx": "mlx"}

collect_ignore = [
    f"src/batchfit/integrations/{module}"
    for module, package in OPTIONAL.items()
    if importlib.util.find_spec(package) is None
]
