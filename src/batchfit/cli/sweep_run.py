"""The body of ``batchfit.cli.sweep``: it imports the library (and torch), so the face imports it only when
the command runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from batchfit.bounds import LARGEST_SIZE
from batchfit.cli.common import Amp
from batchfit.cli.common import Mode
from batchfit.cli.common import check_outputs
from batchfit.cli.common import console
from batchfit.cli.common import parse_margin
from batchfit.cli.workloads import load_workload
from batchfit.cli.workloads import resolve_factory
from batchfit.devices.presets import refuse_preset
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.files import STDOUT
from batchfit.search.cache import ResultCache
from batchfit.step.factory import check_options
from batchfit.sweep.api import grid_configs
from batchfit.sweep.api import sweep_grid
from batchfit.sweep.results import SweepResult


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
        for value in grid[name]:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_SIZE:
                raise InputError(f"--grid {name}={value} is past any size a tensor can have: at most {LARGEST_SIZE:,}")
    if not grid:
        raise InputError("give at least one --grid NAME=V1,V2,... (e.g. --grid seq_len=128,256,512)")
    return grid


@dataclass(frozen=True)
class WorkloadBuilder:
    """Builds a configuration's workload by its spec (picklable: a sweep's worker process builds it too)."""

    spec: str
    fixed: dict[str, Any]

    @property
    def __name__(self) -> str:
        return self.spec

    def __call__(self, **knobs: Any) -> Any:
        return load_workload(self.spec, **self.fixed, **knobs)

    def check_knobs(self, knobs: dict[str, Any]) -> None:
        """An ``InputError`` for a knob the workload does not take, before any configuration is sent."""
        name, factory = resolve_factory(self.spec)
        check_options(name, factory, {**self.fixed, **knobs})


@dataclass(frozen=True)
class SpecFunction:
    """The function ``module:function`` or ``path/to/file.py:function``, found where it is called."""

    spec: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return resolve_factory(self.spec)[1](*args, **kwargs)


def _factory(spec: str, fixed: dict[str, Any], grid: dict[str, list[Any]]) -> WorkloadBuilder:
    clash = sorted(set(fixed) & set(grid))
    if clash:
        raise InputError(f"{', '.join(clash)} is both a fixed option and a --grid knob: give it in one place")
    resolve_factory(spec)  # an unknown workload fails before any work
    return WorkloadBuilder(spec, fixed)


def _measure(spec: str | None) -> SpecFunction | None:
    if spec is None:
        return None
    if ":" not in spec:
        raise InputError(f"--measure {spec!r} must be module:function or path/to/file.py:function")
    resolve_factory(spec)  # a missing function fails before any work
    return SpecFunction(spec)


def _engine_options(**given: Any) -> dict[str, Any]:
    """The engine options given on the command line (``--slots cuda:0,cuda:1`` as a list)."""
    options = {key: value for key, value in given.items() if value is not None}
    if "slots" in options:
        options["slots"] = [slot.strip() for slot in options["slots"].split(",") if slot.strip()]
    return options


def run_sweep(
    *,
    workload: str,
    grid: list[str],
    device: str,
    batch_size: int | None,
    auto_adjust: bool,
    min_batch_size: int,
    strategy: str,
    estimate: str,
    rules: Path | None,
    mode: Mode | None,
    max_new_tokens: int | None,
    seq_len: int | None,
    image_size: int | None,
    amp: Amp | None,
    margin: str,
    max_trials: int | None,
    measure: str | None,
    json_path: Path | None,
    cache: bool,
    cache_dir: Path | None,
    engine: str,
    slots: str | None,
    workers: int | None,
    ray_address: str | None,
    partition: str | None,
    time_min: int | None,
    gpus_per_task: float | None,
    cpus_per_task: int | None,
    slurm_folder: Path | None,
    max_parallel: int | None,
    debug: bool,
) -> None:
    """The body of ``batchfit sweep`` (see its help): the largest batch of every configuration in a grid, each searched from an estimate."""
    refuse_preset(device)
    if json_path is not None and str(json_path) == STDOUT:
        raise InputError(
            "--json - cannot hold a sweep's results: the file is rewritten after every configuration, so a re-run "
            "resumes from it; give a path such as sweep.json"
        )
    check_outputs(json_path)  # a folder, a socket or a missing folder fails before the first configuration
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
    options = _engine_options(
        slots=slots,
        workers=workers,
        address=ray_address,
        partition=partition,
        time_min=time_min,
        gpus_per_task=gpus_per_task,
        cpus_per_task=cpus_per_task,
        folder=str(slurm_folder) if slurm_folder is not None else None,
        max_parallel=max_parallel,
    )
    start = time.perf_counter()
    with console.status("Sweeping", spinner="dots") as status:

        def progress(counts: Any) -> None:
            status.update(
                f"Sweeping: {counts['done']}/{len(grid_configs(knobs))} done, {counts['running']} running, {counts['failed']} failed"
            )

        result = sweep_grid(
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
            engine=engine,
            engine_options=options or None,
            progress=progress,
        )
    console.print(sweep_table(result))
    console.print(f"[bold green]{escape(result.summary(seconds=time.perf_counter() - start))}[/]")
    if json_path is not None:
        console.print(f"Wrote {json_path}")
    if result.records and all(record.get("failure") for record in result.records):
        raise NoBatchFitsError(
            "no configuration gave an answer: each raised or its worker died (the table says why); "
            "fix it and run the same command again to retry them",
            [],
        )
    if result.records and all(record.get("error") for record in result.records):
        raise NoBatchFitsError(
            f"no configuration fitted on {result.device} (the table says why for each): "
            "give more memory (e.g. a larger sim: capacity) or smaller configurations",
            [],
        )


def sweep_table(result: SweepResult) -> Table:
    """One row per configuration: knobs, batch used, estimate and its source, trials, peak."""
    table = Table(title=f"Sweep on {result.device}", title_justify="left")
    slots = ["ran on"] if result.ran_on is not None else []
    for column in [*result.knobs, "batch size", "estimated", "trials", "peak", *slots, "note"]:
        table.add_column(column, justify="right" if column not in ("note", "ran on") else "left")
    for record in result.records:
        estimated = f"{record['estimated']} ({record['estimate_source']})" if record.get("estimated") else ""
        note = "cache" if record.get("cached") else (record.get("error") or "")[:60]
        peak = format_bytes(record["peak_bytes"]) if record.get("peak_bytes") else ""
        row = [*(str(record[k]) for k in result.knobs), str(record["batch_size_used"]), estimated]
        where = [_ran_on(record)] if slots else []
        table.add_row(*row, str(len(record["trials"])), peak, *where, escape(note))
    return table


def _ran_on(record: dict[str, Any]) -> str:
    """Where an engine ran the configuration: its slot, and the attempt when it was sent again."""
    ran = record.get("ran_on") or {}
    attempt = f" (attempt {ran['attempt']})" if ran.get("attempt", 1) > 1 else ""
    return escape(str(ran.get("slot", ""))) + attempt


def run_cache_list(
    *,
    cache_dir: Path | None,
    debug: bool,
) -> None:
    """The body of ``batchfit cache-list`` (see its help): show every stored result: what it was for, where, the batch size and when."""
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


def run_cache_clear(
    *,
    cache_dir: Path | None,
    debug: bool,
) -> None:
    """The body of ``batchfit cache-clear`` (see its help): delete every stored result."""
    store = ResultCache(cache_dir)
    console.print(f"Removed {store.clear()} results from {store.path}.", highlight=False)
