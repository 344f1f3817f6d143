"""Calling a workload factory with options: which it takes, and a clear error for those it does not."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from batchfit.errors import InputError


def check_options(name: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """A ``ValueError`` naming the options ``factory`` (a workload factory called as ``name``) does not take, or
    the arguments it needs and will not get."""
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [key for key in options if key not in parameters and not takes_any]
    if unknown:
        flags = ", ".join("--" + key.replace("_", "-") for key in unknown)
        accepted = ", ".join("--" + key.replace("_", "-") for key in parameters) or "no options"
        raise InputError(f"workload {name} does not take {flags} (it takes {accepted})")
    required = [
        key
        for key, parameter in parameters.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and key not in options
    ]
    if required:
        needed = ", ".join(required)
        raise InputError(
            f"workload {name} needs {needed}, which batchfit cannot give: a workload function is called with "
            "no arguments but the options it takes and the command line gives (--seq-len, --image-size, --amp): "
            "give the others defaults, "
            "or wrap it in a function that passes them"
        )


def accepted_options(factory: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The options ``factory`` takes (all of them when it takes ``**kwargs``)."""
    parameters = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return options
    return {key: value for key, value in options.items() if key in parameters}
