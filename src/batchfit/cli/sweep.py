"""``batchfit sweep`` (the per-configuration search) and ``batchfit cache list|clear``."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Annotated
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from batchfit.cli.common import AmpOption
from batchfit.cli.common import CacheDir
from batchfit.cli.common import Debug
from batchfit.cli.common import ImageSize
from batchfit.cli.common import SeqLen
from batchfit.cli.common import app
from batchfit.cli.common import cli_errors
from batchfit.cli.common import console
from batchfit.cli.common import parse_margin
from batchfit.cli.workloads import load_workload
from batchfit.cli.workloads import resolve_factory
from batchfit.devices.resolve import refuse_preset
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.search.cache import ResultCache
from batchfit.search.strategies import STRATEGIES
from batchfit.sweep.api import sweep_grid as run_sweep
from batchfit.sweep.results import SweepResult
from batchfit.sweep.runner import ESTIMATE_SOURCES

cache_app = typer.Typer(
    help="The result cache: list or clear stored search results.",
    epilog="Example: batchfit cache list --cache-dir ~/.cache/batchfit",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")


class Mode(str, Enum):
    train = "train"
    eval = "eval"
    generate = "generate"


def parse_value(text: str) -> Any:
    """``"128"`` is an int, ``"0.5"`` a float, ``"true"``/``"false"`` a bool, anything else a string."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_grid(specs: list[str]) -> dict[str, list[Any]]:
    """``["seq_len=128,256", "top_k=1,2"]`` as ``{"seq_len": [128, 256], "top_k": [1, 2]}``."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        name, equals, values = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not equals or not name.isidentifier() or not values.strip():
            raise InputError(f"--grid {spec!r} is not NAME=V1,V2,...: write e.g. --grid seq_len=128,256,512")
        if name in grid:
            raise InputError(f"--grid names {name} twice: give all its values in one --grid {name}=V1,V2")
        grid[name] = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
    if not grid:
        raise InputError("give at least one --grid NAME=V1,V2,... (e.g. --grid seq_len=128,256,512)")
    return grid


def _factory(spec: str, fixed: dict[str, Any], grid: dict[str, list[Any]]) -> Any:
    clash = sorted(set(fixed) & set(grid))
    if clash:
        raise InputError(f"{', '.join(clash)} is both a fixed option and a --grid knob: give it in one place")
    resolve_factory(spec)  # an unknown workload fails before any work

    def build(**knobs: Any) -> Any:
        return load_workload(spec, **fixed, **knobs)

    build.__name__ = spec
    return build


def _measure(spec: str | None) -> Any:
    if spec is None:
        return None
    if ":" not in spec:
        raise InputError(f"--measure {spec!r} must be module:function or path/to/file.py:function")
    return resolve_factory(spec)[1]


@app.command(
    "sweep",
    epilog="Example: batchfit sweep gpt-tiny --grid seq_len=32,64,128 --grid layers=2,4 --device sim:256MiB --json sweep.json\n\n"
    'Rules file (--rules, JSON or TOML): {"base_batch_size": 64, "knobs": {"max_crops": [{"upto": 2, "scale": 1.0}, '
    '{"upto": 12, "scale": 0.3}, {"scale": 0.25}], "num_active_blocks": {"ratio_of": 24}}}',
)
@cli_errors
def sweep(
    workload: Annotated[str, typer.Argument(help="A built-in name, module:function or path/to/file.py:function.")],
    grid: Annotated[list[str], typer.Option(help="A knob and its values, NAME=V1,V2,... (repeat per knob).")],
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps or sim:CAPACITY.")] = "auto",
    batch_size: Annotated[
        int | None, typer.Option("--batch-size", "--max-batch-size", help="Upper limit, never exceeded.")
    ] = None,
    auto_adjust: Annotated[bool, typer.Option(help="Search each configuration; off: use --batch-size as is.")] = True,
    min_batch_size: Annotated[int, typer.Option(help="Smallest size to consider.")] = 1,
    strategy: Annotated[
        str, typer.Option(help=f"One of: {', '.join(STRATEGIES)} (grow: estimate, x1.5 up, then bisect).")
    ] = "auto",
    estimate: Annotated[str, typer.Option(help="Where the starting estimate comes from, in order.")] = ",".join(
        ESTIMATE_SOURCES
    ),
    rules: Annotated[Path | None, typer.Option(help="Scale-factor rules, a .json or .toml file.")] = None,
    mode: Annotated[Mode | None, typer.Option(help="train, eval or generate, for workloads that take it.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to generate, with --mode generate.")] = None,
    seq_len: SeqLen = None,
    image_size: ImageSize = None,
    amp: AmpOption = None,
    margin: Annotated[str, typer.Option(help="Headroom: bytes, a size like 512MiB, or a fraction like 0.05.")] = "0",
    max_trials: Annotated[int | None, typer.Option(help="At most this many trials per configuration.")] = None,
    measure: Annotated[
        str | None, typer.Option(help="module:function(knobs, batch_size, workload) run with each batch found.")
    ] = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", "--results", help="Results file: written after every configuration, resumed."),
    ] = None,
    cache: Annotated[bool, typer.Option(help="Answer configurations searched before from the result cache.")] = True,
    cache_dir: CacheDir = None,
    debug: Debug = False,
) -> None:
    """The largest batch of every configuration in a grid, each searched from an estimate."""
    refuse_preset(device)
    knobs = parse_grid(grid)
    fixed = {
        "seq_len": seq_len,
        "image_size": image_size,
        "amp_dtype": amp.value if amp else None,
        "mode": mode.value if mode else None,
        "max_new_tokens": max_new_tokens,
    }
    fixed = {key: value for key, value in fixed.items() if value is not None}
    factory = _factory(workload, fixed, knobs)
    sources = [source.strip() for source in estimate.split(",") if source.strip()]
    store: Any = (cache_dir or True) if cache else False
    start = time.perf_counter()
    with console.status("Sweeping", spinner="dots"):
        result = run_sweep(
            factory,
            knobs,
            device=device,
            max_batch_size=batch_size,
            min_batch_size=min_batch_size,
            auto_adjust=auto_adjust,
            strategy=strategy,
            estimate=sources,
            rules=rules,
            results_path=json_path,
            measure=_measure(measure),
            cache=store,
            margin=parse_margin(margin),
            max_trials=max_trials,
            log=lambda line: console.print(escape(line), highlight=False, soft_wrap=True),
            name=workload,
        )
    console.print(sweep_table(result))
    console.print(f"[bold green]{escape(result.summary(seconds=time.perf_counter() - start))}[/]")
    if json_path is not None:
        console.print(f"Wrote {json_path}")
    if result.records and all(record.get("error") for record in result.records):
        raise NoBatchFitsError(
            f"no configuration fitted on {result.device} (the table says why for each): "
            "give more memory (e.g. a larger sim: capacity) or smaller configurations",
            [],
        )


def sweep_table(result: SweepResult) -> Table:
    """One row per configuration: knobs, batch used, estimate and its source, trials, peak."""
    table = Table(title=f"Sweep on {result.device}", title_justify="left")
    for column in [*result.knobs, "batch size", "estimated", "trials", "peak", "note"]:
        table.add_column(column, justify="right" if column != "note" else "left")
    for record in result.records:
        estimated = f"{record['estimated']} ({record['estimate_source']})" if record.get("estimated") else ""
        note = "cache" if record.get("cached") else (record.get("error") or "")[:60]
        peak = format_bytes(record["peak_bytes"]) if record.get("peak_bytes") else ""
        row = [*(str(record[k]) for k in result.knobs), str(record["batch_size_used"]), estimated]
        table.add_row(*row, str(len(record["trials"])), peak, escape(note))
    return table


@cache_app.command("list", epilog="Example: batchfit cache list --cache-dir /tmp/batchfit-cache")
@cli_errors
def cache_list(cache_dir: CacheDir = None, debug: Debug = False) -> None:
    """Show every stored result: what it was for, where, the batch size and when."""
    store = ResultCache(cache_dir)
    entries = store.entries()
    console.print(f"{store.path}: {len(entries)} results", highlight=False, soft_wrap=True)
    table = Table()
    for column in ("stored", "workload", "device", "batch size", "trials", "key"):
        table.add_column(column, justify="right" if column in ("batch size", "trials") else "left")
    for entry in entries:
        stored = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.created))
        trials = str(len(entry.result.get("trials", [])))
        table.add_row(stored, escape(entry.label), entry.device, str(entry.batch_size), trials, entry.key[:12])
    console.print(table)


@cache_app.command("clear", epilog="Example: batchfit cache clear")
@cli_errors
def cache_clear(cache_dir: CacheDir = None, debug: Debug = False) -> None:
    """Delete every stored result."""
    store = ResultCache(cache_dir)
    console.print(f"Removed {store.clear()} results from {store.path}.", highlight=False)
