"""Load a workload from the command line: a built-in name, ``module:function`` or ``file.py:function``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfit.examples import BUILTIN_WORKLOADS
from batchfit.workload import Workload

SPEC_HELP = "a built-in name (see `batchfit list-workloads`), module:function or path/to/file.py:function"


def describe_builtins() -> dict[str, str]:
    """Each built-in workload's name and the first line of its docstring."""
    return {
        name: (build.__doc__ or "").strip().splitlines()[0].replace("``", "")
        for name, build in BUILTIN_WORKLOADS.items()
    }


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"workload file {path} does not exist: give {SPEC_HELP}")
    name = f"batchfit_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and name.startswith(error.name):
            raise ValueError(
                f"no module named {name!r}: check the spelling or run from its folder ({SPEC_HELP})"
            ) from None
        raise


def resolve_factory(spec: str) -> tuple[str, Callable[..., Any]]:
    """The workload's name and the function that builds it."""
    if spec in BUILTIN_WORKLOADS:
        return spec, BUILTIN_WORKLOADS[spec]
    if ":" not in spec:
        known = ", ".join(BUILTIN_WORKLOADS)
        raise ValueError(f"unknown workload {spec!r}: use one of {known}, or module:function / file.py:function")
    where, _, function = spec.rpartition(":")
    module = _load_file(Path(where)) if where.endswith(".py") else _load_module(where)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ValueError(f"{where} has no function {function!r}: define it to return a batchfit.Workload")
    return spec, factory


def check_options(name: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [key for key in options if key not in parameters and not takes_any]
    if unknown:
        flags = ", ".join("--" + key.replace("_", "-") for key in unknown)
        accepted = ", ".join("--" + key.replace("_", "-") for key in parameters) or "no options"
        raise ValueError(f"workload {name} does not take {flags} (it takes {accepted})")


def _accepted(factory: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options
    return {key: value for key, value in options.items() if key in parameters}


def load_workload(spec: str, *, only_accepted: bool = False, **options: Any) -> Workload:
    """Build the workload named by ``spec``, passing the options it takes (``None`` ones are left out).
    An option it does not take is an error, or, with ``only_accepted``, left out.

    >>> load_workload("mlp").name
    'mlp'
    """
    name, factory = resolve_factory(spec)
    given = {key: value for key, value in options.items() if value is not None}
    if only_accepted:
        given = _accepted(factory, given)
    check_options(name, factory, given)
    workload = factory(**given)
    if not isinstance(workload, Workload):
        raise TypeError(
            f"{name} returned {type(workload).__name__}, not a batchfit.Workload: "
            "return batchfit.Workload(model, sample_batch, loss_fn, optimizer)"
        )
    if workload.name == type(workload.model).__name__:
        workload.name = name
    return workload
