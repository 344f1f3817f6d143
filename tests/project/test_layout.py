"""The package's layout is a contract: layers import only downward, the maths imports no torch, the core
never reaches the CLI or an integration, no module takes another's private name, ``import batchfit`` stays
light, and the public names are pinned."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import batchfit as bf

PACKAGE = Path(bf.__file__).parent
SHARED = {"errors", "_version", "_lazy", "bounds", "files"}
# What each layer may import, lowest first: step < devices < search < {runtime, sweep, parallel, tokens, throughput}
# < workflows < {integrations, cli}, with planning (maths) beside them. A layer always may import itself and the shared
# leaves above (errors, the version, atomic file writes, lazy public names, the bound on sizes), which import
# nothing of batchfit but one another.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_version": set(),
    "_lazy": set(),
    "bounds": set(),
    "files": set(),
    "step": set(),
    "devices": {"step"},
    "planning": set(),
    "search": {"step", "devices"},
    "runtime": {"step", "devices", "search", "planning"},
    "sweep": {"step", "devices", "search", "runtime", "planning"},
    "parallel": {"step", "devices", "search", "planning"},
    "tokens": {"step", "devices", "search"},
    "throughput": {"step", "devices", "search"},
    "workflows": {"step", "devices", "search", "runtime", "planning", "sweep", "parallel", "tokens", "throughput"},
    "integrations": {"step", "devices", "search", "runtime", "planning", "sweep", "throughput", "workflows"},
    "cli": {
        "step",
        "devices",
        "search",
        "runtime",
        "planning",
        "sweep",
        "parallel",
        "tokens",
        "throughput",
        "workflows",
        "integrations",
    },
    "__init__": {
        "step",
        "devices",
        "search",
        "runtime",
        "planning",
        "sweep",
        "parallel",
        "tokens",
        "throughput",
        "workflows",
    },
}
# Deprecated aliases left where a module was, for one release: each only hands its names on from the module's new
# place (with a DeprecationWarning), so it may reach the layer the module moved up to. (alias, layer) -> what moved.
ALIASES = {
    ("search/throughput.py", "throughput"): "the throughput-optimal batch, now batchfit.throughput; goes next release",
}
HEAVY = [
    "sympy",
    "rich",
    "matplotlib",
    "lightning",
    "transformers",
    "mlx",
    "typer",
    "batchfit.cli",
    "batchfit.step.builtin_workloads",
    "batchfit.parallel",  # the FSDP2 layer loads when a Parallelism is made, not with bf.find_max_batch_size
]
PUBLIC = [
    "ACCELERATORS",
    "AnalyticEstimate",
    "BatchPlan",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "EvalMicrobatcher",
    "GradientAccumulator",
    "MemoryEstimate",
    "MemoryModel",
    "Microbatcher",
    "ModelDoesNotFitError",
    "MpsDevice",
    "InputError",
    "InputTypeError",
    "NoBatchFitsError",
    "NoiseScale",
    "NoiseScaleEstimator",
    "ResultCache",
    "STRATEGIES",
    "ScaleRules",
    "SearchResult",
    "SearchSettings",
    "SearchSpace",
    "SimulatedDevice",
    "StateSnapshot",
    "SweepResult",
    "ThroughputResult",
    "TokenBudget",
    "TraceDevice",
    "TraceError",
    "Trial",
    "Workload",
    "__version__",
    "analytic_estimate",
    "critical_batch_by_training",
    "estimate_memory",
    "executable_batch_size",
    "find_max_batch_size",
    "find_optimal_batch_size",
    "checkpointing_frontier",
    "CheckpointingFrontier",
    "find_token_budget",
    "format_bytes",
    "goodput",
    "is_oom",
    "make_strategy",
    "measure_noise_scale",
    "parse_bytes",
    "plan_batch",
    "probe_batch_size",
    "search_workload",
    "sweep_grid",
    "versions",
]


def layer_of(path: Path, root: Path = PACKAGE) -> str:
    return path.relative_to(root).with_suffix("").parts[0]


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """Every ``(module, names, at_module_level)`` that ``path`` imports at run time (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not _type_checking_only(node, parents):
            top = parents.get(node) is tree
            if isinstance(node, ast.Import):
                found += [(alias.name, [], top) for alias in node.names]
            elif node.level == 0 and node.module:
                found.append((node.module, [alias.name for alias in node.names], top))
    return found


def imported_layers(module: str, names: list[str]) -> set[str]:
    """The batchfit layers an import reaches: ``from batchfit import x`` reaches layer ``x``."""
    parts = module.split(".")
    if parts[0] != "batchfit":
        return set()
    if len(parts) > 1:
        return {parts[1]}
    return {name for name in names if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()}


def violations(root: Path = PACKAGE) -> list[str]:
    """Every import in the package that breaks the layering, as one readable line each."""
    found = []
    for path in sorted(root.rglob("*.py")):
        layer = layer_of(path, root)
        allowed = ALLOWED[layer] | SHARED | {layer}
        allowed |= {reached for alias, reached in ALIASES if Path(alias) == path.relative_to(root)}
        for module, names, top in imports(path):
            for reached in imported_layers(module, names) - allowed:
                found.append(f"{path.relative_to(root)} imports {module} (layer {reached!r}, not allowed in {layer!r})")
            private = [
                name
                for name in names
                if name.startswith("_") and not name.startswith("__") and name not in ("_version", "_lazy")
            ]
            own_package = ".".join(("batchfit", *path.relative_to(root).parent.parts))
            if module.startswith("batchfit") and module != own_package and private:
                found.append(f"{path.relative_to(root)} imports the private name(s) {private} of {module}")
            if layer == "planning" and top and module.split(".")[0] == "torch":
                found.append(f"{path.relative_to(root)} imports torch at module level (planning is maths)")
    return found


def test_every_import_respects_the_layers():
    assert violations() == []


def test_an_alias_that_may_reach_up_only_hands_names_on():
    """The aliases exempt from the layers hold a docstring, imports and ``__getattr__``, nothing else."""
    for alias, _ in ALIASES:
        body = ast.parse((PACKAGE / alias).read_text()).body
        kinds = [type(node).__name__ for node in body if not isinstance(node, (ast.Import, ast.ImportFrom))]
        assert kinds == ["Expr", "FunctionDef"] and body[-1].name == "__getattr__", alias


def test_the_shared_file_writes_import_nothing_of_batchfit_but_its_errors():
    reached = {module for module, _, _ in imports(PACKAGE / "files.py") if module.startswith("batchfit")}
    assert reached <= {"batchfit.errors"}


def module_of(path: Path, root: Path = PACKAGE) -> str:
    """``batchfit.devices.units`` for ``devices/units.py``; a package is its ``__init__.py``."""
    parts = ("batchfit", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The batchfit modules one import statement names: ``from a.b import c`` names ``a.b.c`` where that is a
    module, else ``a.b``; relative imports are resolved against ``module``."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{package}.{base}" if base else package
    return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names} & modules


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every batchfit module and the batchfit modules it imports when it runs: at module level or inside a
    function, never under ``if TYPE_CHECKING:``."""
    paths = {module_of(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not _type_checking_only(node, parents):
                graph[module] |= _targets(node, module, path.name == "__init__.py", set(paths)) - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_import_circles():
    """No two batchfit modules import each other, directly or around a circle. An import counts where it runs:
    at module level or inside a function (a function-local import still ties the two modules; moving an import
    into a function to dodge a circle hides it, and is caught), but not under ``if TYPE_CHECKING:`` (it never
    runs), with no exception. ``from a import b`` is an arrow to
    the module ``a.b`` where ``b`` is one, else to package ``a``'s ``__init__``; relative imports are resolved."""
    found = circles(import_graph())
    file_of = {module_of(path): path.relative_to(PACKAGE.parent) for path in PACKAGE.rglob("*.py")}
    files = ["\n  ".join(str(file_of[module]) for module in circle) for circle in found]
    assert found == [], "import circles (each a set of files that import one another):\n  " + "\n\n  ".join(files)


def test_the_circle_check_catches_a_function_local_import(tmp_path):
    """The check itself can fail: a function-local or relative import closes a circle; a TYPE_CHECKING one does not."""
    root = tmp_path / "batchfit"
    (root / "pkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "pkg" / "__init__.py").write_text("from batchfit.pkg.low import LOW\n")
    (root / "pkg" / "low.py").write_text("LOW = 1\n\ndef high():\n    from batchfit.pkg import high\n")
    (root / "pkg" / "high.py").write_text("from .low import LOW\n")
    (root / "hints.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import batchfit.typed\n")
    (root / "typed.py").write_text("import batchfit.hints\n")
    assert circles(import_graph(root)) == [["batchfit.pkg.high", "batchfit.pkg.low"]]


def test_the_contract_catches_a_core_module_importing_the_cli(tmp_path):
    """The check itself can fail: a copy of the package where the prober imports the CLI breaks it."""
    copy = tmp_path / "batchfit"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    prober = copy / "search" / "prober.py"
    prober.write_text(prober.read_text() + "\nfrom batchfit.cli.report import write_json\n")
    planning = copy / "planning" / "lr.py"
    planning.write_text("import torch\n" + planning.read_text())
    assert violations(copy) == [
        "planning/lr.py imports torch at module level (planning is maths)",
        "search/prober.py imports batchfit.cli.report (layer 'cli', not allowed in 'search')",
    ]


def test_the_top_of_the_package_holds_a_folder_per_layer_and_the_shared_leaves():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    layers = {name for name in ALLOWED if name not in SHARED and name != "__init__"}
    leaves = {f"{name}.py" for name in SHARED} | {"__init__.py", "py.typed"}
    assert entries == layers | leaves, sorted(entries)


def test_every_package_says_what_it_holds_and_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, (
            f"{init.parent.name}/__init__.py needs a docstring: what it holds, what it may import"
        )


def test_import_batchfit_loads_nothing_heavy():
    code = f"import sys, batchfit; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []


def test_the_public_names_are_pinned_and_each_imports():
    assert sorted(bf.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(bf, name) is not None


def test_no_public_name_shadows_a_module():
    modules = {path.stem for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists()}
    assert "search" in modules and "sweep" in modules
    assert sorted(set(PUBLIC) & modules) == []


def test_subpackages_import_by_their_path():
    for name in ["batchfit.search.strategies", "batchfit.sweep", "batchfit.sweep.api", "batchfit.planning.plan"]:
        assert importlib.import_module(name).__name__ == name
    assert importlib.import_module("batchfit.search") is sys.modules["batchfit.search"]


def test_no_user_facing_text_names_the_internal_documents():
    """Users never saw the documents the project was specified from: the package's code, docstrings, messages,
    help and the README cite the paper or project, or state the rule."""
    pattern = re.compile(r"\bseeds?\b\W*(?:s\W+)?0\d\d", re.IGNORECASE)
    texts = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.json"), PACKAGE.parents[1] / "README.md"]
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in texts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_every_deliberate_bad_input_error_is_an_input_error():
    """The command line prints an InputError as the user's mistake and anything else as a bug: so the
    package raises its bad-input errors as InputError (a ValueError) or InputTypeError (also a TypeError)."""
    pattern = re.compile(r"raise (ValueError|TypeError)\(")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
    assert issubclass(bf.InputError, ValueError) and issubclass(bf.InputTypeError, (bf.InputError, TypeError))
