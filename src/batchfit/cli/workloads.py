"""Load a workload from the command line: a built-in name, ``module:function`` or ``file.py:function``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.step.builtin_workloads import BUILTIN_WORKLOADS
from batchfit.step.factory import accepted_options
from batchfit.step.factory import check_options
from batchfit.step.workload import Workload

SPEC_HELP = "a built-in name (see `batchfit list-workloads`), module:function or path/to/file.py:function"
FRAMEWORKS = ("torch", "mlx")
MLX_MISSING = 'MLX is not installed: pip install "batchfit[mlx]" (Apple silicon; on Linux pip install "mlx[cpu]")'
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
    """
    if framework == "mlx":
        return {name: line for name, (_, line) in MLX_BUILTINS.items()}
    return {
        name: (build.__doc__ or "").strip().splitlines()[0].replace("``", "")
        for name, build in BUILTIN_WORKLOADS.items()
    }


def _import_mlx(module: str = "batchfit.integrations.mlx") -> Any:
    """Import an MLX module of batchfit; a missing MLX is the user's to fix, in one line."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if (error.name or "").split(".")[0] == "mlx":
            raise InputError(MLX_MISSING) from None
        raise


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise InputError(f"workload file {path} does not exist: give {SPEC_HELP}")
    name = f"batchfit_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        _raise_if_mlx_missing(error, str(path))
        raise
    except SyntaxError as error:  # also a file that is not UTF-8 text
        raise InputError(f"workload file {path} is not valid Python: {error.msg}, line {error.lineno}") from None
    return module


@contextlib.contextmanager
def _current_folder_importable() -> Iterator[None]:
    """The current folder first on ``sys.path`` while a module is imported, as ``python -m`` has it
    (the ``batchfit`` script alone would not find ``mypkg.workloads`` in the folder it runs in)."""
    folder = os.getcwd()
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


def _load_module(name: str) -> Any:
    try:
        with _current_folder_importable():
            return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and name.startswith(error.name):
            raise InputError(
                f"no module named {name!r}: check the spelling or run from its folder ({SPEC_HELP})"
            ) from None
        _raise_if_mlx_missing(error, name)
        raise


def _raise_if_mlx_missing(error: ModuleNotFoundError, where: str) -> None:
    if (error.name or "").split(".")[0] == "mlx":
        raise InputError(f"{where} imports MLX: {MLX_MISSING}") from None


def resolve_factory(spec: str, framework: str | None = "torch") -> tuple[str, Callable[..., Any]]:
    """The workload's name and the function that builds it; ``framework`` (``"torch"``, ``"mlx"``,
    ``None`` for either) says which built-ins count, and with ``"mlx"`` MLX must be installed."""
    if framework not in (*FRAMEWORKS, None):
        raise InputError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    if framework == "mlx":
        _import_mlx()
    if spec in BUILTIN_WORKLOADS and framework != "mlx":
        return spec, BUILTIN_WORKLOADS[spec]
    if spec in MLX_BUILTINS and framework != "torch":
        return spec, getattr(_import_mlx("batchfit.integrations.mlx.examples"), MLX_BUILTINS[spec][0])
    if spec in MLX_BUILTINS:
        raise InputError(
            f"{spec} is an MLX workload, not a torch one: only `batchfit find` runs MLX workloads (without --framework torch)"
        )
    if spec in BUILTIN_WORKLOADS:
        raise InputError(f"{spec} is a torch workload, not an MLX one: drop --framework mlx")
    if ":" not in spec:
        known = ", ".join(
            {"torch": BUILTIN_WORKLOADS, "mlx": MLX_BUILTINS}.get(framework, {**BUILTIN_WORKLOADS, **MLX_BUILTINS})
        )
        raise InputError(f"unknown workload {spec!r}: use one of {known}, or module:function / file.py:function")
    where, _, function = spec.rpartition(":")
    module = _load_file(Path(where)) if where.endswith(".py") else _load_module(where)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise InputError(f"{where} has no function {function!r}: define it to return a batchfit.Workload")
    return spec, factory


def load_workload(spec: str, *, framework: str | None = "torch", only_accepted: bool = False, **options: Any) -> Any:
    """Build the workload named by ``spec``, passing the options it takes (``None`` ones are left out).
    An option it does not take is an error, or, with ``only_accepted``, left out. ``framework``:
    ``"torch"`` (a ``batchfit.Workload``), ``"mlx"`` (a ``batchfit.integrations.mlx.MlxWorkload``)
    or ``None`` (either).

    >>> load_workload("mlp").name
    'mlp'
    """
    name, factory = resolve_factory(spec, framework)
    given = {key: value for key, value in options.items() if value is not None}
    if only_accepted:
        given = accepted_options(factory, given)
    check_options(name, factory, given)
    workload = factory(**given)
    _check_kind(name, workload, framework)
    if workload.name == type(workload.model).__name__:
        workload.name = name
    return workload


def _check_kind(name: str, workload: Any, framework: str | None) -> None:
    """``workload`` is what ``framework`` runs: a torch ``Workload``, an ``MlxWorkload``, or (``None``) either."""
    if isinstance(workload, Workload) and framework != "mlx":
        return
    if getattr(workload, "framework", None) == "mlx" and framework != "torch":
        return
    wanted = {"torch": "a batchfit.Workload", "mlx": "a batchfit.integrations.mlx.MlxWorkload"}
    raise InputTypeError(
        f"{name} returned {type(workload).__name__}, not {wanted.get(framework, 'a batchfit.Workload or an MlxWorkload')}: "
        "return batchfit.Workload(model, sample_batch, loss_fn, optimizer) "
        "(MLX: batchfit.integrations.mlx.MlxWorkload, with --framework mlx)"
    )
