"""sweep: the largest batch of every configuration in a grid, each found from an estimate.

Each configuration is searched independently, under an upper limit (``max_batch_size``, the
command line's ``--batch-size``: never exceeded), starting from an estimate taken, in order, from a
memory model fitted across the configurations already measured (``crossconfig``), the trace
device, or scale-factor rules (``rules``). Every configuration's record is written to the results
file as soon as it is known, so a crash loses nothing and a re-run resumes; with the result cache
a configuration searched before costs no trial at all.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.search.cached import CacheSpec
from batchfit.search.runner import DeviceSpec
from batchfit.search.settings import SearchSettings
from batchfit.step.workload import Workload
from batchfit.sweep.config_search import Measure
from batchfit.sweep.config_search import SweepSettings
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.options import check_engine
from batchfit.sweep.fan_out import FanOut
from batchfit.sweep.results import SweepResult
from batchfit.sweep.rules import ScaleRules
from batchfit.sweep.runner import SweepRunner
from batchfit.sweep.sources import ESTIMATE_SOURCES

logger = logging.getLogger("batchfit")


def grid_configs(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the first knob varying slowest.

    >>> grid_configs({"seq_len": [128, 256], "top_k": [1, 2]})[:3]
    [{'seq_len': 128, 'top_k': 1}, {'seq_len': 128, 'top_k': 2}, {'seq_len': 256, 'top_k': 1}]
    """
    if not isinstance(grid, Mapping) or not grid:
        raise InputError("the grid must map each knob to its values, e.g. {'seq_len': [128, 256]}")
    values = []
    for name, options in grid.items():
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
            raise InputError(f"grid knob {name!r} needs a non-empty list of values, got {options!r}")
        values.append(list(dict.fromkeys(options)))  # a repeated value is one configuration
    return [dict(zip(grid, combination, strict=True)) for combination in itertools.product(*values)]


def sweep_grid(
    factory: Callable[..., Workload],
    grid: Mapping[str, Sequence[Any]],
    *,
    device: DeviceSpec = None,
    max_batch_size: int | None = None,
    min_batch_size: int = 1,
    auto_adjust: bool = True,
    strategy: str = "auto",
    estimate: Sequence[str] = ESTIMATE_SOURCES,
    rules: ScaleRules | Mapping[str, Any] | str | Path | None = None,
    results_path: str | Path | None = None,
    measure: Measure | None = None,
    cache: CacheSpec = True,
    margin: int | float | str = 0,
    max_trials: int | None = None,
    steps: int = 2,
    log: Callable[[str], None] | None = None,
    name: str | None = None,
    settings: SearchSettings | None = None,
    engine: str = "auto",
    engine_options: EngineOptions | Mapping[str, Any] | None = None,
    progress: Callable[[Mapping[str, int]], None] | None = None,
) -> SweepResult:
    """The largest batch of every configuration of ``grid``: ``factory(**knobs)`` builds each one's
    ``Workload`` (any mode: ``train``, ``eval``, ``generate``).

    ``max_batch_size`` is the upper limit (the CLI's ``--batch-size``); with ``auto_adjust=False``
    it is the one size used, checked once per configuration. The search starts from the first
    estimate that ``estimate`` names: ``"model"`` (fitted across the configurations measured so
    far), ``"trace"`` (fake tensors) or ``"rules"`` (``rules``: a ``ScaleRules``, a dict or a
    .json/.toml file). ``strategy`` is ``auto`` (default) or another strategy, e.g. ``grow`` (x1.5 up,
    then bisect; at most 5 trials unless ``max_trials``). Records are written to ``results_path``
    after every configuration (atomically), and a re-run with the same path measures only what is
    missing. ``measure(knobs, batch_size, workload)`` runs the real measurement with the batch found;
    a dict it returns joins the record. ``cache`` (default on) answers configurations searched
    before with zero trials. ``log`` receives one line per trial and configuration (default: the ``batchfit`` logger).
    ``settings`` (a ``SearchSettings``) gives the search settings in one object; ``max_batch_size``,
    ``min_batch_size``, ``strategy``, ``margin``, ``max_trials`` and ``steps`` are its aliases (one form or the
    other).

    ``engine`` fans the configurations out, each in a fresh process: ``"local"`` (this node's slots:
    every visible GPU, or ``engine_options={"workers": 2}`` on a simulated device), ``"slurm"`` (submitit job
    arrays; ``pip install 'batchfit[slurm]'``) or ``"ray"`` (``pip install 'batchfit[ray]'``); ``"inline"``
    runs them one after another in this process; ``"auto"`` (default) is ``local`` where a string ``device``
    sees several GPUs, else ``inline``. ``engine_options`` (an ``EngineOptions`` or a dict of its fields) says
    where; ``progress`` receives the counts (done, running, failed) as records arrive. Under an engine the
    factory and ``measure`` must be importable by another process (functions at a module's top level) and
    ``device`` a string; a configuration whose factory raises, or whose process dies twice, is recorded with
    its error and the sweep goes on (a later run retries it).

    >>> import batchfit as bf
    >>> from batchfit.step.builtin_workloads import gpt_tiny
    >>> result = sweep_grid(gpt_tiny, {"seq_len": [16, 32]}, device="sim:32MiB", cache=False)
    >>> [r["batch_size_used"] for r in result.records], result.total_trials
    ([66, 33], 4)
    """
    configs = grid_configs(grid)
    unknown = [source for source in estimate if source not in ESTIMATE_SOURCES]
    if unknown:
        raise InputError(f"unknown estimate source(s) {unknown}: choose from {', '.join(ESTIMATE_SOURCES)}")
    search = SearchSettings.merged(
        settings,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        strategy=strategy,
        margin=margin,
        max_trials=max_trials,
        steps=steps,
    ).replace(trace=False)  # the sweep traces through its estimate sources, once per configuration
    if not auto_adjust and search.max_batch_size is None:
        raise InputError("auto_adjust=False uses one fixed size: give it as max_batch_size (--batch-size)")
    if isinstance(rules, (str, Path)):
        rules = ScaleRules.load(rules)
    elif isinstance(rules, Mapping):
        rules = ScaleRules.from_dict(rules)
    settings = SweepSettings(search, auto_adjust, tuple(estimate), rules, log or logger.info)
    label = name or getattr(factory, "__name__", "workload")
    options = _engine_options(engine_options)
    chosen = choose_engine(engine, device, options)
    if chosen == "inline":
        if options != EngineOptions():
            raise InputError("engine_options are for the local, slurm or ray engine: give engine= one of them")
        return SweepRunner(factory, device, settings, cache, measure).run(configs, results_path, label)
    fan = FanOut(factory, _device_text(device), settings, cache, measure, progress)
    return fan.run(chosen, options, configs, results_path, label)


def choose_engine(engine: str, device: DeviceSpec, options: EngineOptions | None = None) -> str:
    """``engine`` as given, or for ``"auto"``: ``local`` when local slots or workers are given, or where a
    string ``device`` (``auto``, ``cuda``) sees several GPUs, else ``inline``."""
    if engine != "auto":
        check_engine(engine)
        return engine
    if options is not None and (options.slots is not None or options.workers is not None):
        return "local"
    if isinstance(device, str) and device in ("auto", "cuda"):
        from batchfit.sweep.engines.local import visible_gpus

        return "local" if visible_gpus() > 1 else "inline"
    return "inline"


def _device_text(device: DeviceSpec) -> str:
    if device is None:
        return "auto"
    if not isinstance(device, str):
        raise InputTypeError(
            f"an engine sends the device to other processes as a string, got {type(device).__name__}: "
            "give device='sim:256MiB', 'cuda' or 'auto'"
        )
    return device


def _engine_options(options: EngineOptions | Mapping[str, Any] | None) -> EngineOptions:
    if options is None or isinstance(options, EngineOptions):
        return options or EngineOptions()
    if not isinstance(options, Mapping):
        raise InputTypeError(f"engine_options must be an EngineOptions or a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(EngineOptions.__dataclass_fields__))
    if unknown:
        raise InputError(
            f"unknown engine option(s) {unknown}: choose from {', '.join(EngineOptions.__dataclass_fields__)}"
        )
    values = dict(options)
    if values.get("slots") is not None:
        values["slots"] = tuple(values["slots"])
    return EngineOptions(**values)
