"""Every third-party package the code imports is declared in ``pyproject.toml``: in ``dependencies`` when
``import batchfit`` or the ``batchfit`` command can reach it unguarded, else in a user-facing extra, behind a
guard (an import inside a function, one under ``try: ... except ImportError``, or a package whose
``__init__`` checks the extra first). ``make test`` installs every extra, so an undeclared import would pass
the suite and fail a plain ``pip install .``: this test, and ``.ci/check_install``, catch it."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

import batchfit as bf

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

PACKAGE = Path(bf.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"
USER_EXTRAS = (
    "plot",
    "lightning",
    "transformers",
    "mlx",
    "slurm",
    "ray",
)  # the others (test, docs, bench) are for working on it
# Packages whose every module may import their extra at module level: their __init__ imports the guard first.
GUARDED_PACKAGES = {"integrations/mlx": "mlx"}


def requirement_name(requirement: str) -> str:
    """``"mlx[cpu]>=0.32; sys_platform == 'linux'"`` -> ``"mlx"``, normalised as PyPI does."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(pyproject: Path = PYPROJECT) -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return {requirement_name(r) for r in project["dependencies"]}, {
        extra: {requirement_name(r) for r in extras.get(extra, [])} for extra in USER_EXTRAS
    }


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a function, or under ``try`` with an ``except ImportError`` (or ``ModuleNotFoundError``)."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = " ".join(ast.unparse(handler.type) for handler in parent.handlers if handler.type is not None)
            if "ImportError" in caught or "ModuleNotFoundError" in caught:
                return True
        node = parent
    return False


def third_party_imports(root: Path = PACKAGE) -> list[tuple[str, str, bool]]:
    """Every ``(file:line, top-level module, guarded)`` the package imports from outside the standard library."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package_guarded = any(path.relative_to(root).as_posix().startswith(p) for p in GUARDED_PACKAGES)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in ("batchfit", "__future__"):
                    continue
                guarded = package_guarded or _guarded(node, parents)
                found.append((f"{path.relative_to(root)}:{node.lineno}", top, guarded))
    return found


def undeclared(root: Path = PACKAGE, pyproject: Path = PYPROJECT) -> list[str]:
    """One line per import that a plain install, or the extra it belongs to, would not satisfy."""
    core, extras = declared(pyproject)
    optional = set().union(*extras.values())
    distributions = packages_distributions()
    problems = []
    for where, module, guarded in third_party_imports(root):
        names = {requirement_name(name) for name in distributions.get(module, [module])}
        if names & core:
            continue
        if not guarded:
            problems.append(f"{where} imports {module} unguarded: declare it in [project] dependencies")
        elif not names & optional:
            problems.append(f"{where} imports {module}: declare it in an extra ({', '.join(USER_EXTRAS)})")
    return problems


def test_every_imported_package_is_declared():
    assert undeclared() == []


def test_the_guarded_packages_check_their_extra_first():
    for package, module in GUARDED_PACKAGES.items():
        init = (PACKAGE / package / "__init__.py").read_text()
        first = next(
            line for line in init.splitlines() if line.startswith(("from ", "import ")) and "__future__" not in line
        )
        assert "_available" in first, f"{package}/__init__.py must import its guard first, not {first!r}"
        assert f"import {module}" in (PACKAGE / package / "_available.py").read_text()


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The check itself can fail: click imported at module level by the CLI (typer no longer brings it), and
    matplotlib imported unguarded, each named with what to do."""
    copy = tmp_path / "batchfit"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    common = copy / "cli" / "common.py"
    common.write_text("import click\n" + common.read_text())
    plots = copy / "cli" / "plots.py"
    plots.write_text("import matplotlib\n" + plots.read_text())
    assert undeclared(copy) == [
        "cli/common.py:1 imports click unguarded: declare it in [project] dependencies",
        "cli/plots.py:1 imports matplotlib unguarded: declare it in [project] dependencies",
    ]


def test_a_guarded_import_must_still_be_in_an_extra(tmp_path):
    copy = tmp_path / "batchfit"
    (copy / "cli").mkdir(parents=True)
    (copy / "cli" / "export.py").write_text("def to_parquet():\n    import pyarrow\n")
    assert undeclared(copy) == [
        "cli/export.py:2 imports pyarrow: declare it in an extra (plot, lightning, transformers, mlx, slurm, ray)"
    ]
