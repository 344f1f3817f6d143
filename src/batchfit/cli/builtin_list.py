"""The built-in workloads' names and what each is, read from their source without importing it: ``batchfit
list-workloads`` answers without loading torch. Building one is ``batchfit.cli.workloads``' work."""

from __future__ import annotations

import ast
import functools
from importlib import util
from pathlib import Path

# MLX built-ins: their builder in batchfit.integrations.mlx.examples, imported only when one is used.
MLX_BUILTINS: dict[str, tuple[str, str]] = {
    "mlx-mlp": (
        "mlx_mlp",
        "An MLX MLP classifier with Adam on a dict batch {features, labels}; the model returns the loss.",
    ),
    "mlx-gpt-tiny": (
        "mlx_gpt_tiny",
        "A 2-layer MLX decoder-only transformer with AdamW on (ids, next ids) token batches.",
    ),
}


def describe_builtins(framework: str = "torch") -> dict[str, str]:
    """Each built-in workload's name and the first line of its docstring (``framework="mlx"``: the MLX ones).

    >>> list(describe_builtins("mlx"))
    ['mlx-mlp', 'mlx-gpt-tiny']
    >>> describe_builtins()["mlp"].split(";")[0]
    'An MLP classifier with Adam on a dict batch {"features", "labels"}'
    """
    if framework == "mlx":
        return {name: line for name, (_, line) in MLX_BUILTINS.items()}
    return dict(_torch_builtins())


@functools.cache
def _torch_builtins() -> tuple[tuple[str, str], ...]:
    """``BUILTIN_WORKLOADS`` of ``batchfit.step.builtin_workloads``, each name with its function's first
    docstring line, from the module's source (the dict literal and the functions it names)."""
    tree = ast.parse(Path(util.find_spec("batchfit.step.builtin_workloads").origin).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    registry = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "BUILTIN_WORKLOADS"
    )
    described = []
    for key, value in zip(registry.keys, registry.values, strict=True):
        doc = ast.get_docstring(functions[value.id]) or ""
        described.append((key.value, doc.strip().splitlines()[0].replace("``", "") if doc else ""))
    return tuple(described)
