"""Load a workload from the command line: a built-in name, ``module:function`` or ``file.py:function``."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import typing
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfit.cli.builtin_list import MLX_BUILTINS
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.step.builtin_workloads import BUILTIN_WORKLOADS
from batchfit.step.factory import accepted_options
from batchfit.step.factory import check_options
from batchfit.step.workload import Workload

SPEC_HELP = "a built-in name (see `batchfit list-workloads`), module:function or path/to/file.py:function"
FRAMEWORKS = ("torch", "mlx")
MLX_MISSING = 'MLX is not installed: pip install "batchfit[mlx]" (Apple silicon; on Linux pip install "mlx[cpu]")'


def _import_mlx(module: str = "batchfit.integrations.mlx") -> Any:
    """Import an MLX module of batchfit; a missing MLX is the user's to fix, in one line."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if (error.name or "").split(".")[0] == "mlx":
            raise InputError(MLX_MISSING) from None
        raise


def _load_file(path: Path) -> Any:
    """The module of a workload file, imported as ``python path/to/file.py`` runs it: the file's folder first on
    ``sys.path``, so the modules beside it (``from model import GPT``) import."""
    if not path.is_file():
        raise InputError(f"workload file {path} does not exist: give {SPEC_HELP}")
    name = f"batchfit_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with importable_from(path.resolve().parent):
            spec.loader.exec_module(module)
    except ModuleNotFoundError as error:
        _raise_if_mlx_missing(error, str(path))
        _raise_if_not_found(error, str(path))
        raise
    except SyntaxError as error:  # also a file that is not UTF-8 text
        raise InputError(f"workload file {path} is not valid Python: {error.msg}, line {error.lineno}") from None
    return module


@contextlib.contextmanager
def importable_from(folder: Path | str) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while the block runs, then ``sys.path`` as it was: a workload file's
    folder (as ``python file.py`` has it), or the current folder for ``module:function`` (as ``python -m``
    has it; the ``batchfit`` script alone would not find ``mypkg.workloads`` in the folder it runs in).

    >>> with importable_from("/nowhere"):
    ...     sys.path[0]
    '/nowhere'
    >>> "/nowhere" in sys.path
    False
    """
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if sys.path and sys.path[0] == entry:
            del sys.path[0]
        elif entry in sys.path:
            sys.path.remove(entry)


def _load_module(name: str) -> Any:
    try:
        with importable_from(os.getcwd()):
            return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and name.startswith(error.name):
            raise InputError(
                f"no module named {name!r}: check the spelling or run from its folder ({SPEC_HELP})"
            ) from None
        _raise_if_mlx_missing(error, name)
        _raise_if_not_found(error, name)
        raise


def _raise_if_not_found(error: ModuleNotFoundError, where: str) -> None:
    """A module the workload imports that is neither installed nor beside it: one line naming both places."""
    if error.name and error.name.split(".")[0] not in sys.stdlib_module_names:
        raise InputError(
            f"{where} imports {error.name!r}, which is neither installed nor beside it: pip install it, or put "
            f"{error.name.split('.')[0]}.py next to the workload file"
        ) from None


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
    if not where.strip() or not function.strip():
        raise InputError(
            f"workload {spec!r} names no {'module or file' if not where.strip() else 'function'}: give {SPEC_HELP}"
        )
    module = _load_file(Path(where)) if where.endswith(".py") else _load_module(where)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise InputError(f"{where} has no function {function!r}: define it to return a batchfit.Workload")
    folder = Path(where).resolve().parent if where.endswith(".py") else Path.cwd()
    return spec, _importing_from(folder, factory)


def _importing_from(folder: Path, factory: Callable[..., Any]) -> Callable[..., Any]:
    """``factory``, called with ``folder`` first on ``sys.path``: a workload that imports its model inside the
    function finds it as the module's own imports did. Its signature is the factory's (``__wrapped__``)."""

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        with importable_from(folder):
            return factory(*args, **kwargs)

    return build


def load_workload(
    spec: str,
    *,
    framework: str | None = "torch",
    only_accepted: bool = False,
    settings: Sequence[str] = (),
    **options: Any,
) -> Any:
    """Build the workload named by ``spec``, passing the options it takes (``None`` ones are left out).
    An option it does not take is an error, or, with ``only_accepted``, left out. ``settings`` are the
    command line's ``--set KEY=VALUE``: each a parameter of the factory, typed as it is annotated
    (``typed_settings``). ``framework``: ``"torch"`` (a ``batchfit.Workload``), ``"mlx"`` (a
    ``batchfit.integrations.mlx.MlxWorkload``) or ``None`` (either).

    >>> load_workload("mlp").name
    'mlp'
    """
    name, factory = resolve_factory(spec, framework)
    given = {key: value for key, value in options.items() if value is not None}
    if only_accepted:
        given = accepted_options(factory, given)
    set_here = typed_settings(name, factory, settings)
    clash = sorted(set(set_here) & set(given))
    if clash:
        raise InputError(f"{', '.join(clash)} is given twice (an option and --set): give it once")
    given |= set_here
    check_options(name, factory, given)
    workload = factory(**given)
    _check_kind(name, workload, framework)
    if workload.name == type(workload.model).__name__:
        workload.name = name
    return workload


def parse_settings(specs: Sequence[str]) -> dict[str, str]:
    """``["n_layer=12", "bias=false"]`` as ``{"n_layer": "12", "bias": "false"}`` (``-`` in a key reads as ``_``).

    >>> parse_settings(["n-layer=12", "dropout=0.1"])
    {'n_layer': '12', 'dropout': '0.1'}
    """
    parsed: dict[str, str] = {}
    for spec in specs:
        key, equals, value = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not equals or not key.isidentifier():
            raise InputError(f"--set {spec!r} is not KEY=VALUE: write e.g. --set n_layer=12")
        if key in parsed:
            raise InputError(f"--set gives {key} twice: give it once")
        parsed[key] = value.strip()
    return parsed


def typed_settings(name: str, factory: Callable[..., Any], specs: Sequence[str]) -> dict[str, Any]:
    """The ``--set KEY=VALUE`` settings for ``factory`` (the workload ``name``), each converted to the type its
    parameter is annotated with (``int``, ``float``, ``bool``, ``str``, and ``X | None`` of those); an
    unannotated one is read as a Python literal (``12``, ``0.5``, ``True``, ``'gelu'``), else kept as text. A key
    the factory does not take is refused, naming the ones it does.

    >>> def gpt(n_layer: int = 12, dropout: float = 0.0, bias: bool = True, name="gpt"): ...
    >>> typed_settings("gpt", gpt, ["n_layer=6", "dropout=0.1", "bias=false", "name=small"])
    {'n_layer': 6, 'dropout': 0.1, 'bias': False, 'name': 'small'}
    """
    raw = parse_settings(specs)
    if not raw:
        return {}
    parameters = _parameters(factory)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unknown = [key for key in raw if key not in parameters and not takes_any]
    if unknown:
        takes = ", ".join(key for key, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
        raise InputError(f"workload {name} has no setting {', '.join(unknown)} for --set: it takes {takes or 'none'}")
    return {key: _typed(key, text, parameters.get(key)) for key, text in raw.items()}


def _parameters(factory: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The factory's parameters, annotations evaluated where they can be (left as written where not)."""
    try:
        return dict(inspect.signature(factory, eval_str=True).parameters)
    except (NameError, TypeError, SyntaxError):
        return dict(inspect.signature(factory).parameters)


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _typed(key: str, text: str, parameter: inspect.Parameter | None) -> Any:
    """``text`` as the type ``parameter`` is annotated with; one line naming the type where it does not read."""
    annotation = parameter.annotation if parameter is not None else inspect.Parameter.empty
    kinds = [k for k in typing.get_args(annotation) if k is not type(None)] or [annotation]
    if text.lower() in ("none", "null") and type(None) in typing.get_args(annotation):
        return None
    kind = kinds[0] if len(kinds) == 1 else None
    if kind is bool:
        if text.lower() not in _BOOLS:
            raise InputError(f"--set {key}={text}: {key} takes true or false")
        return _BOOLS[text.lower()]
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise InputError(f"--set {key}={text}: {key} takes {'an int' if kind is int else 'a number'}") from None
    if kind is str:
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


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
