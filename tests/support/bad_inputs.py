"""The bad-input table of the reliability campaign: malformed inputs to the library and the CLI.

Each ``BadInput`` names its category, the input, and the one-line error it must give:

- **library** entries (``call``) must raise ``error`` (a ``ValueError`` or ``TypeError``) whose
  message is one line and matches ``expect``;
- **CLI** entries (``args``, run with typer's ``CliRunner``) must exit with code 2, no traceback and
  one line on stderr, ``error: ...`` matching ``expect``. ``usage=True`` marks click's own usage
  errors (a value of the wrong type or not among the choices): exit code 2, no traceback, the bad
  option named, in click's framed usage message (several lines; see ``benchmarks/RELIABILITY.md``).

Every entry runs in an empty scratch folder (``{tmp}`` in ``args``; the folder is passed to
``call``) holding only its ``files`` (bytes, or ``None`` for a folder). Afterwards the folder must
hold exactly the same files with the same bytes: a failed run writes no output, no partial or
temporary file, and leaves a pre-existing results file as it was.

``known_issue`` marks an entry whose behaviour is wrong today; its check is expected to fail
(``xfail(strict=True)`` in the tests), so fixing the issue turns it into a pass to claim.
``tests/search/test_inputs.py`` and the CLI tests hold further bad-input cases; this table does not repeat them.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf


@dataclass(frozen=True)
class BadInput:
    id: str
    category: str
    expect: str  # a regex the error's one line must contain
    call: Callable[[Path], Any] | None = None
    error: type[Exception] = ValueError
    args: tuple[str, ...] = ()
    files: dict[str, bytes | None] = field(default_factory=dict)
    usage: bool = False
    known_issue: str | None = None

    @property
    def surface(self) -> str:
        return "library" if self.call is not None else "CLI"


def _model_and_batch() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return nn.Linear(4, 2), (torch.randn(3, 4), torch.tensor([0, 1, 1]))


def _find(**overrides: Any) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        model, batch = _model_and_batch()
        kwargs = {"loss_fn": F.cross_entropy, "device": "sim:1MiB", "trace": False, **overrides}
        return bf.find_max_batch_size(model, kwargs.pop("batch", batch), **kwargs)

    return call


def _tiny_factory(**knobs: Any) -> bf.Workload:
    model, batch = _model_and_batch()
    return bf.Workload(model, batch, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))


def _sweep(grid: Any, **options: Any) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        rest = dict(options)
        path, factory = rest.pop("results_path", None), rest.pop("factory", _tiny_factory)
        results = None if path is None else tmp / path
        return bf.sweep_grid(factory, grid, device="sim:1MiB", cache=False, results_path=results, **rest)

    return call


def _plan(**kwargs: Any) -> Callable[[Path], Any]:
    return lambda tmp: bf.plan_batch(**kwargs)


KEEP = {"out.json": b'{"previous": "result"}\n'}  # a results file from an earlier run, to be left as it was
TINY_WORKLOAD = b"""
import torch
import batchfit as bf

def make():
    model = torch.nn.Linear(4, 2)
    batch = (torch.randn(3, 4), torch.tensor([0, 1, 1]))
    return bf.Workload(model, batch, torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters()))
"""
SWEEP = ("sweep", "gpt-tiny", "--device", "sim:32MiB", "--no-cache")


# fmt: off
TABLE: list[BadInput] = [
    # -- wrong types (library) ------------------------------------------------------------------------
    BadInput("optimizer-factory-returns-none", "wrong type", r"optimizer factory returned NoneType, not a torch\.optim\.Optimizer",
             _find(optimizer=lambda params: None), TypeError),
    BadInput("loss-fn-a-string", "wrong type", r"loss_fn must be a function, got 'mse'.*loss_fn\(output, targets\)",
             _find(loss_fn="mse"), TypeError),
    BadInput("step-fn-a-number", "wrong type", r"step_fn must be a function, got 42", _find(step_fn=42), TypeError),
    BadInput("strategy-none", "wrong type", r"strategy must be a name or an object with \.next", _find(strategy=None),
             TypeError),
    BadInput("steps-a-string", "wrong type", r"steps must be at least 1 .*got '2'", _find(steps="2")),
    BadInput("min-batch-size-a-bool", "wrong type", r"min_batch_size must be an integer of at least 1, got True",
             _find(min_batch_size=True)),
    BadInput("max-batch-size-a-bool", "wrong type", r"max_batch_size must be an integer >= min_batch_size .*got True",
             _find(max_batch_size=True)),
    BadInput("max-trials-a-string", "wrong type", r"max_trials must be .*got '3'", _find(max_trials="3")),
    BadInput("margin-a-list", "wrong type", r"margin must be a byte count or a string like '8GiB', got \[1\]",
             _find(margin=[1]), TypeError),
    BadInput("probe-size-a-string", "wrong type", r"batch_size must be an integer of at least 1, got '8'",
             lambda tmp: bf.probe_batch_size(*_model_and_batch(), "8", loss_fn=F.cross_entropy, device="sim:1MiB")),
    BadInput("estimate-size-zero", "wrong type", r"batch_size must be an integer of at least 1, got 0",
             lambda tmp: bf.estimate_memory(*_model_and_batch(), 0, loss_fn=F.cross_entropy)),
    BadInput("plan-devices-fractional", "wrong type", r"devices must be a positive integer, got 2\.5",
             _plan(micro_batch_size=16, global_batch_size=64, devices=2.5)),
    # -- empty or inconsistent batches (library) ------------------------------------------------------
    BadInput("batch-none", "empty or inconsistent batch", r"holds no tensor with a batch dimension.*next\(iter\(loader\)\)",
             _find(batch=None)),
    BadInput("batch-empty-tuple", "empty or inconsistent batch", r"holds no tensor with a batch dimension",
             _find(batch=())),
    BadInput("batch-zero-rows", "empty or inconsistent batch", r"the sample batch is empty \(batch length 0\)",
             _find(batch=(torch.randn(0, 4), torch.zeros(0, dtype=torch.long)))),
    BadInput("batch-a-scalar", "empty or inconsistent batch", r"holds no tensor with a batch dimension",
             _find(batch=torch.tensor(3.0))),
    BadInput("batch-numpy", "empty or inconsistent batch", r"holds no tensor with a batch dimension",
             _find(batch=np.zeros((3, 4), dtype=np.float32))),
    BadInput("batch-dict-lengths-differ", "empty or inconsistent batch", r"different batch lengths \[2, 3\]",
             _find(batch={"x": torch.randn(3, 4), "y": torch.randn(2)})),
    # -- nonsense capacities (library) ----------------------------------------------------------------
    BadInput("capacity-zero", "nonsense capacity", r"capacity must be positive, got 0", lambda tmp: bf.SimulatedDevice(0)),
    BadInput("capacity-negative", "nonsense capacity", r"capacity '-1GiB' is not a size: write it like '512MiB'",
             lambda tmp: bf.SimulatedDevice("-1GiB")),
    BadInput("capacity-nan", "nonsense capacity", r"capacity 'nan' is not a size", lambda tmp: bf.SimulatedDevice("nan")),
    BadInput("capacity-below-a-byte", "nonsense capacity", r"capacity must be positive, got '0\.1B'",
             lambda tmp: bf.SimulatedDevice("0.1B")),
    BadInput("capacity-a-float", "nonsense capacity", r"capacity must be a byte count or a string like '8GiB'",
             lambda tmp: bf.SimulatedDevice(1.5e6), TypeError),
    BadInput("capacity-unknown-preset", "nonsense capacity", r"'a100-80gbx' is neither a size .* nor a GPU preset",
             lambda tmp: bf.TraceDevice("a100-80gbx")),
    BadInput("device-meta", "nonsense capacity", r"device type 'meta' is not supported",
             _find(device=torch.device("meta"))),
    BadInput("margin-above-capacity", "nonsense capacity", r"margin 2\.0 MiB .*capacity", _find(margin="2MiB")),
    # -- malformed grids and plans (library) ----------------------------------------------------------
    BadInput("grid-empty", "malformed grid", r"the grid must map each knob to its values", _sweep({})),
    BadInput("grid-knob-without-values", "malformed grid", r"grid knob 'seq_len' needs a non-empty list of values",
             _sweep({"seq_len": []})),
    BadInput("grid-values-a-string", "malformed grid", r"grid knob 'seq_len' needs a non-empty list of values, got '128'",
             _sweep({"seq_len": "128"})),
    BadInput("grid-unknown-estimate", "malformed grid", r"unknown estimate source\(s\) \['magic'\]",
             _sweep({"seq_len": [1]}, estimate=["magic"])),
    BadInput("grid-factory-returns-none", "malformed grid", r"factory returned NoneType for seq_len=1, not a Workload",
             _sweep({"seq_len": [1]}, factory=lambda **knobs: None), TypeError),
    BadInput("rules-without-knobs", "malformed grid", r"scale rules need a 'knobs' table",
             _sweep({"seq_len": [1]}, rules={"knobs": 5})),
    BadInput("sweep-results-a-folder", "unwritable output", r"is a folder: give a file name such as sweep\.json",
             _sweep({"seq_len": [1]}, results_path="results", auto_adjust=False, max_batch_size=2), files={"results": None}),
    BadInput("sweep-results-not-json", "unreadable file", r"out\.json is not a batchfit sweep results file",
             _sweep({"seq_len": [1]}, results_path="out.json", auto_adjust=False, max_batch_size=2),
             files={"out.json": b"{half a file"}),
    BadInput("plan-two-targets", "malformed plan", r"give exactly one target",
             _plan(micro_batch_size=16, global_batch_size=64, global_batch_tokens=4096, seq_len=64)),
    BadInput("plan-unknown-lr-scaling", "malformed plan", r"lr_scaling must be one of linear, sqrt, none, got 'cubic'",
             _plan(micro_batch_size=16, global_batch_size=64, lr_scaling="cubic", base_lr=1e-3, base_batch_size=32)),
    BadInput("plan-lr-without-its-batch", "malformed plan", r"give base_lr and base_batch_size together",
             _plan(micro_batch_size=16, global_batch_size=64, base_lr=1e-3)),
    # -- the CLI: capacities, bounds and types ---------------------------------------------------------
    BadInput("cli-capacity-zero", "nonsense capacity", r"capacity must be positive, got '0'",
             args=("find", "mlp", "--device", "sim:0", "--json", "{tmp}/out.json")),
    BadInput("cli-capacity-empty", "nonsense capacity", r"capacity '' is not a size",
             args=("find", "mlp", "--device", "sim:", "--json", "{tmp}/out.json"), files=KEEP),
    BadInput("cli-margin-negative", "nonsense capacity", r"a fractional margin must be in \[0, 1\), got margin=-1\.0",
             args=("find", "mlp", "--margin", "-1", "--json", "{tmp}/out.json")),
    BadInput("cli-model-fills-the-device", "nonsense capacity", r"already holds .* before any batch",
             args=("find", "mlp", "--device", "sim:1KiB", "--json", "{tmp}/out.json"), files=KEEP),
    BadInput("cli-size-not-a-number", "wrong type", r"'--max-batch-size'", usage=True,
             args=("find", "mlp", "--max-batch-size", "abc")),
    BadInput("cli-amp-unknown", "wrong type", r"'--amp'", usage=True, args=("find", "mlp", "--amp", "fp8")),
    BadInput("cli-seq-len-zero", "wrong type", r"seq_len must be a positive integer, got 0",
             args=("find", "gpt-tiny", "--seq-len", "0", "--device", "sim:64MiB", "--json", "{tmp}/out.json")),
    BadInput("cli-image-size-negative", "wrong type", r"image_size must be a positive integer, got -1",
             args=("find", "cnn-small", "--image-size", "-1", "--device", "sim:64MiB")),
    BadInput("cli-min-batch-size-huge", "wrong type", r"min_batch_size must be at most 2,147,483,647",
             args=("find", "mlp", "--device", "sim:64MiB", "--min-batch-size", str(10**30), "--json", "{tmp}/out.json")),
    BadInput("cli-seq-len-huge", "wrong type", r"--seq-len must be at most 2,147,483,647",
             args=("find", "gpt-tiny", "--seq-len", str(10**30), "--device", "sim:64MiB")),
    BadInput("cli-rank-without-gpus", "wrong type", r"--rank only applies to a sharded run: add --gpus N",
             args=("find", "mlp", "--device", "sim:64MiB", "--rank", "1", "--json", "{tmp}/out.json")),
    BadInput("cli-param-dtype-without-gpus", "wrong type", r"--param-dtype only applies to a sharded run",
             args=("estimate", "mlp", "--gpu", "a100-40gb", "--param-dtype", "bf16")),
    BadInput("cli-dtypes-without-gpus", "wrong type", r"--param-dtype, --reduce-dtype apply to a WORKLOAD the plan",
             args=("plan", "--micro-batch-size", "4", "--global-batch-size", "8", "--param-dtype", "bf16",
                   "--reduce-dtype", "fp32")),
    BadInput("cli-estimate-reserve-above-capacity", "nonsense capacity", r"reserve_bytes must be in \[0, ",
             args=("estimate", "mlp", "--gpu", "a100-40gb", "--reserve", "50GiB", "--json", "{tmp}/out.json")),
    BadInput("cli-estimate-batch-size-zero", "wrong type", r"batch.size must be",
             args=("estimate", "mlp", "--capacity", "64MiB", "--batch-size", "0", "--json", "{tmp}/out.json")),
    BadInput("cli-optimal-tolerance", "wrong type", r"tolerance must be in \[0, 1\), got tolerance=2\.0",
             args=("optimal", "mlp", "--device", "sim:64MiB", "--tolerance", "2", "--json", "{tmp}/out.json"), files=KEEP),
    BadInput("cli-optimal-no-timed-steps", "wrong type", r"timed_steps >= 1",
             args=("optimal", "mlp", "--device", "sim:64MiB", "--timed-steps", "0")),
    # -- the CLI: malformed plans ----------------------------------------------------------------------
    BadInput("cli-plan-micro-batch-zero", "malformed plan", r"micro_batch_size must be a positive integer, got 0",
             args=("plan", "--micro-batch-size", "0", "--global-batch-size", "64", "--json", "{tmp}/out.json"), files=KEEP),
    BadInput("cli-plan-lr-scaling-unknown", "malformed plan", r"'--lr-scaling'", usage=True,
             args=("plan", "--micro-batch-size", "16", "--global-batch-size", "64", "--lr-scaling", "cubic")),
    BadInput("cli-plan-lr-not-finite", "malformed plan", r"base_lr must be a positive, finite number, got nan",
             args=("plan", "--micro-batch-size", "16", "--global-batch-size", "64", "--base-lr", "nan",
                   "--base-batch-size", "8", "--json", "{tmp}/out.json")),
    BadInput("cli-plan-dataset-empty", "malformed plan", r"dataset_size must be a positive integer, got 0",
             args=("plan", "--micro-batch-size", "16", "--global-batch-size", "64", "--dataset-size", "0")),
    BadInput("cli-critical-micro-batch-zero", "malformed plan", r"--micro-batch-size must be a positive integer, got 0",
             args=("critical", "mlp", "--micro-batch-size", "0", "--json", "{tmp}/out.json")),
    BadInput("cli-critical-sizes-not-numbers", "malformed plan", r"--batch-sizes must be positive integers .* got '8,abc'",
             args=("critical", "mlp", "--steps", "3", "--empirical", "--batch-sizes", "8,abc", "--json", "{tmp}/out.json")),
    BadInput("cli-critical-population-zero", "empty or inconsistent batch", r"sample_size must be a positive integer, got 0",
             args=("critical", "mlp", "--population", "0")),
    # -- the CLI: malformed grids ----------------------------------------------------------------------
    BadInput("cli-grid-no-values", "malformed grid", r"--grid 'seq_len=' is not NAME=V1,V2",
             args=(*SWEEP, "--grid", "seq_len=", "--json", "{tmp}/out.json")),
    BadInput("cli-grid-no-name", "malformed grid", r"--grid '=1,2' is not NAME=V1,V2", args=(*SWEEP, "--grid", "=1,2")),
    BadInput("cli-grid-only-commas", "malformed grid", r"grid knob 'seq_len' needs a non-empty list of values",
             args=(*SWEEP, "--grid", "seq_len=,,", "--json", "{tmp}/out.json"), files=KEEP),
    BadInput("cli-grid-words-for-numbers", "malformed grid", r"seq_len must be a positive integer, got 'abc'",
             args=(*SWEEP, "--grid", "seq_len=abc", "--json", "{tmp}/out.json"), files=KEEP),
    BadInput("cli-grid-strategy-unknown", "malformed grid", r"unknown strategy 'nope'",
             args=(*SWEEP, "--grid", "seq_len=16", "--strategy", "nope", "--json", "{tmp}/out.json")),
    # -- the CLI: unreadable files ---------------------------------------------------------------------
    BadInput("cli-rules-broken-json", "unreadable file", r"rules file .*rules\.json is not valid JSON",
             args=(*SWEEP, "--grid", "seq_len=16", "--rules", "{tmp}/rules.json"), files={"rules.json": b"{not json"}),
    BadInput("cli-rules-broken-toml", "unreadable file", r"rules file .*rules\.toml is not valid TOML",
             args=(*SWEEP, "--grid", "seq_len=16", "--rules", "{tmp}/rules.toml"), files={"rules.toml": b"x = "}),
    BadInput("cli-rules-a-folder", "unreadable file", r"rules file .*rules\.json does not exist",
             args=(*SWEEP, "--grid", "seq_len=16", "--rules", "{tmp}/rules.json"), files={"rules.json": None}),
    BadInput("cli-sweep-results-garbage", "unreadable file", r"out\.json is not a batchfit sweep results file",
             args=(*SWEEP, "--grid", "seq_len=16", "--json", "{tmp}/out.json"), files={"out.json": b"\x00\xff garbage"}),
    BadInput("cli-workload-missing-function", "unreadable file", r"has no function 'nothing'",
             args=("find", "{tmp}/work.py:nothing"), files={"work.py": TINY_WORKLOAD}),
    BadInput("cli-workload-a-folder", "unreadable file", r"workload file .*work\.py does not exist",
             args=("find", "{tmp}/work.py:make"), files={"work.py": None}),
    BadInput("cli-workload-factory-needs-an-argument", "unreadable file",
             r"workload .*work\.py:make needs width, which batchfit cannot give",
             args=("find", "{tmp}/work.py:make", "--device", "sim:64MiB"),
             files={"work.py": b"def make(width):\n    raise AssertionError('never called')\n"}),
    BadInput("cli-workload-syntax-error", "unreadable file", r"work\.py.*(syntax|line 1)",
             args=("find", "{tmp}/work.py:make", "--json", "{tmp}/out.json"), files={"work.py": b"def make(:\n"}),
    BadInput("cli-workload-not-utf8", "unreadable file", r"work\.py.*(decode|UTF-8|utf-8)",
             args=("find", "{tmp}/work.py:make"), files={"work.py": b"\xff\xfe not text"}),
    # -- the CLI: unwritable output paths --------------------------------------------------------------
    BadInput("cli-json-under-a-file", "unwritable output", r"cannot write .*afile/out\.json: folder .*afile does not exist",
             args=("find", "mlp", "--device", "sim:64MiB", "--no-trace", "--max-trials", "1", "--json", "{tmp}/afile/out.json"),
             files={"afile": b"a file"}),
    BadInput("cli-sweep-json-under-a-file", "unwritable output", r"cannot write .*afile/s\.json: folder .*afile does not exist",
             args=(*SWEEP, "--grid", "seq_len=16", "--no-auto-adjust", "--batch-size", "2", "--json", "{tmp}/afile/s.json"),
             files={"afile": b"a file"}),
    BadInput("cli-plan-json-a-folder", "unwritable output", r"cannot write .*results: it is a folder",
             args=("plan", "--micro-batch-size", "16", "--global-batch-size", "64", "--json", "{tmp}/results"),
             files={"results": None}),
    BadInput("cli-plot-folder-missing", "unwritable output", r"cannot write .*p\.png: folder .*nofolder does not exist",
             args=("find", "mlp", "--device", "sim:64MiB", "--no-trace", "--max-trials", "1", "--plot", "{tmp}/nofolder/p.png",
                   "--json", "{tmp}/out.json")),
    BadInput("cli-cache-dir-a-file", "unwritable output", r"cache dir .*afile is a file",
             args=("cache", "list", "--cache-dir", "{tmp}/afile"), files={"afile": b"a file"}),
]
# fmt: on


# -- checking one entry ---------------------------------------------------------------------------------


def _populate(tmp: Path, files: dict[str, bytes | None]) -> None:
    for name, content in files.items():
        if content is None:
            (tmp / name).mkdir()
        else:
            (tmp / name).write_bytes(content)


def _contents(tmp: Path) -> dict[str, bytes | None]:
    """Every file under ``tmp`` but Python's own byte cache, which importing a user's module writes."""
    paths = (p for p in sorted(tmp.rglob("*")) if "__pycache__" not in p.parts)
    return {str(p.relative_to(tmp)): None if p.is_dir() else p.read_bytes() for p in paths}


def _check_library(case: BadInput, tmp: Path, seen: list[str]) -> list[str]:
    try:
        case.call(tmp)
    except Exception as error:
        text = str(error)
        seen.append(f"{type(error).__name__}: {text}")
        problems = (
            [] if isinstance(error, case.error) else [f"raised {type(error).__name__}, not {case.error.__name__}"]
        )
        if "\n" in text.strip():
            problems.append("the message is not one line")
        if not re.search(case.expect, text):
            where = traceback.extract_tb(error.__traceback__)[-1]
            problems.append(
                f"message {text[:160]!r} (from {Path(where.filename).name}:{where.lineno}) lacks {case.expect!r}"
            )
        return problems
    return ["no error was raised"]


def _check_cli(case: BadInput, tmp: Path, invoke: Callable[[list[str]], Any], seen: list[str]) -> list[str]:
    result = invoke([arg.replace("{tmp}", str(tmp)) for arg in case.args])
    stderr, uncaught = result.stderr, result.exception
    if isinstance(uncaught, SystemExit):
        uncaught = None
    seen.append(
        f"exit {result.exit_code}: "
        + (f"a traceback, {type(uncaught).__name__}: {uncaught}" if uncaught else " ".join(stderr.split()))
    )
    problems = [] if result.exit_code == 2 else [f"exit code {result.exit_code}, not 2"]
    if uncaught is not None:
        problems.append(f"an uncaught {type(uncaught).__name__}: {str(uncaught)[:120]}")
    if "Traceback" in result.output + stderr:
        problems.append("a traceback was printed")
    if case.usage:
        if "Invalid value" not in stderr:
            problems.append(f"not a usage error: {stderr[:160]!r}")
    elif not (stderr.startswith("error: ") and stderr.count("\n") == 1):
        problems.append(f"stderr is not one 'error: ' line: {stderr[:200]!r}")
    if not re.search(case.expect, " ".join(stderr.split())):
        problems.append(f"stderr {stderr.strip()[:200]!r} lacks {case.expect!r}")
    return problems


@dataclass
class Checked:
    """What one entry did: the problems found (none: it behaved) and the error it gave."""

    case: BadInput
    problems: list[str]
    seen: str


def check(case: BadInput, tmp: Path, invoke: Callable[[list[str]], Any]) -> Checked:
    """Run ``case`` in the empty folder ``tmp`` and check the error it gives and the files it leaves."""
    _populate(tmp, case.files)
    before, seen = _contents(tmp), []
    problems = _check_library(case, tmp, seen) if case.call is not None else _check_cli(case, tmp, invoke, seen)
    after = _contents(tmp)
    if after != before:
        changed = sorted(name for name in set(before) | set(after) if before.get(name, b"") != after.get(name, b""))
        problems.append(f"files created or changed: {changed}")
    return Checked(case, problems, seen[0].replace(str(tmp), "{tmp}") if seen else "")


def cli_invoker() -> Callable[[list[str]], Any]:
    """typer's CliRunner on the batchfit app, wide enough that no message wraps."""
    from typer.testing import CliRunner

    from batchfit.cli.app import app

    runner = CliRunner()
    return lambda args: runner.invoke(app, args, env={"COLUMNS": "200"})
