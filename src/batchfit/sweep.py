"""sweep: the largest batch of every configuration in a grid (seed 002), each found from an estimate.

Each configuration is searched independently, under an upper limit (``max_batch_size``, seed
002's ``--batch_size``: never exceeded), starting from an estimate taken, in order, from a
memory model fitted across the configurations already measured (``crossconfig``), the trace
device, or scale-factor rules (``rules``). Every configuration's record is written to the results
file as soon as it is known, so a crash loses nothing and a re-run resumes; with the result cache
a configuration searched before costs no trial at all.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit.crossconfig import CrossConfigModel
from batchfit.crossconfig import MeasuredConfig
from batchfit.devices.resolve import resolve_device
from batchfit.rules import ScaleRules
from batchfit.search.cached import CachedSearch
from batchfit.search.cached import CacheSpec
from batchfit.search.cached import open_cache
from batchfit.search.result import NoBatchFitsError
from batchfit.search.result import SearchResult
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import _trace_guess
from batchfit.search.runner import search
from batchfit.search.runner import usable_bytes
from batchfit.search.strategies import Auto
from batchfit.search.strategies import Grow
from batchfit.search.strategies import Halving
from batchfit.search.strategies import Strategy
from batchfit.search.strategies import make_strategy
from batchfit.sweep_file import SweepFile
from batchfit.trial import Trial
from batchfit.units import format_bytes
from batchfit.workload import Workload
from batchfit.workloads import _check_options

logger = logging.getLogger("batchfit")

ESTIMATE_SOURCES = ("model", "trace", "rules")
SEED_GROW_MAX_TRIALS = 5  # seed 002: "Maximum attempts: 5"
RESERVED = ("batch_size_used", "trials", "peak_bytes", "seconds", "estimated", "starting_with", "error")
Measure = Callable[[dict[str, Any], int, Workload], Any]


def grid_configs(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the first knob varying slowest.

    >>> grid_configs({"seq_len": [128, 256], "top_k": [1, 2]})[:3]
    [{'seq_len': 128, 'top_k': 1}, {'seq_len': 128, 'top_k': 2}, {'seq_len': 256, 'top_k': 1}]
    """
    if not isinstance(grid, Mapping) or not grid:
        raise ValueError("the grid must map each knob to its values, e.g. {'seq_len': [128, 256]}")
    values = []
    for name, options in grid.items():
        if isinstance(options, (str, bytes)) or not isinstance(options, Sequence) or not options:
            raise ValueError(f"grid knob {name!r} needs a non-empty list of values, got {options!r}")
        values.append(list(dict.fromkeys(options)))  # a repeated value is one configuration
    return [dict(zip(grid, combination, strict=True)) for combination in itertools.product(*values)]


def describe(knobs: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in knobs.items())


@dataclass
class SweepResult:
    """Every configuration's record (seed 002's ``summary``), in grid order."""

    records: list[dict[str, Any]]
    knobs: list[str]
    device: str
    path: Path | None

    @property
    def total_trials(self) -> int:
        """Trials run by this sweep and the runs it resumed (a cache hit counts none)."""
        return sum(len(record["trials"]) for record in self.records)

    def batch_size(self, **knobs: Any) -> int | None:
        """The batch size used for one configuration."""
        for record in self.records:
            if all(record.get(k) == v for k, v in knobs.items()):
                return record["batch_size_used"]
        raise KeyError(f"no configuration {describe(knobs)} in this sweep")

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.records, "knobs": self.knobs, "device": self.device}


@dataclass
class _Settings:
    max_batch_size: int | None
    min_batch_size: int
    auto_adjust: bool
    strategy: str
    estimate: tuple[str, ...]
    rules: ScaleRules | None
    margin: int | float | str
    max_trials: int | None
    steps: int
    log: Callable[[str], None]


class _Sweep:
    def __init__(self, factory: Callable[..., Workload], device: DeviceSpec, settings: _Settings,
                 cache: CacheSpec, measure: Measure | None):  # fmt: skip
        self.factory, self.device, self.settings, self.measure = factory, device, settings, measure
        self.cache = open_cache(cache)
        self.file: SweepFile | None = None

    def run(self, configs: list[dict[str, Any]], path: str | Path | None, name: str) -> SweepResult:
        _check_options(name, self.factory, configs[0])
        first = self._build(configs[0])
        dev = resolve_device(self.device, first.model)
        header = {"workload": name, "knobs": list(configs[0]),
                  "device": {"name": dev.name, "capacity_bytes": dev.capacity_bytes(), "simulated": dev.simulated},
                  "settings": self._header_settings(first)}  # fmt: skip
        self.file = SweepFile(path, header)
        log = self.settings.log
        for knobs in configs:
            done = self.file.done(knobs)
            if done is not None:
                log(f"Already measured {describe(knobs)}: batch size {done['batch_size_used']} (resumed from {path})")
                continue
            self.file.add(self._one(knobs, first if knobs is configs[0] else self._build(knobs)))
        records = [self.file.done(knobs) for knobs in configs]
        return SweepResult(records, list(configs[0]), dev.name, self.file.path)

    def _header_settings(self, workload: Workload) -> dict[str, Any]:
        s = self.settings
        return {"mode": workload.mode, "max_batch_size": s.max_batch_size, "min_batch_size": s.min_batch_size,
                "auto_adjust": s.auto_adjust, "margin": str(s.margin), "steps": s.steps}  # fmt: skip

    def _build(self, knobs: dict[str, Any]) -> Workload:
        workload = self.factory(**knobs)
        if not isinstance(workload, Workload):
            raise TypeError(
                f"the sweep's factory returned {type(workload).__name__} for {describe(knobs)}, not a Workload"
            )
        return workload

    def _one(self, knobs: dict[str, Any], workload: Workload) -> dict[str, Any]:
        """Search one configuration (or take it from the cache) and run ``measure`` on the answer."""
        log, label = self.settings.log, describe(knobs)
        log(f"Testing {label}")
        started = time.perf_counter()
        dev = resolve_device(self.device, workload.model)
        limit = usable_bytes(dev, self.settings.margin)[1]
        place = self._place(workload, dev, limit, knobs)
        record: dict[str, Any] = {**knobs, "mode": workload.mode}
        result = place.lookup(started) if place is not None else None
        try:
            if result is None:
                result = self._search(knobs, workload, dev, limit, record)
                if place is not None:
                    place.store(result)
        except NoBatchFitsError as error:
            log(f"✗ No batch size fits for {label}: {error}")
            used = None if self.settings.auto_adjust else self.settings.max_batch_size  # fixed: used anyway
            return {**record, "batch_size_used": used, "fits": False, "error": str(error), "limit_bytes": limit,
                    "trials": [t.to_dict() for t in error.trials], "seconds": time.perf_counter() - started}  # fmt: skip
        record.update(_result_fields(result, limit, time.perf_counter() - started))
        log(
            f"Using batch size: {result.batch_size} for {label}"
            + (" (from the result cache, no trials)" if result.cached else "")
        )
        if self.measure is not None:
            log(f"Measuring {label} with batch size {result.batch_size}...")
            _merge(record, self.measure(dict(knobs), result.batch_size, workload))
        return record

    def _place(self, workload: Workload, dev: Any, limit: int | None, knobs: dict[str, Any]) -> CachedSearch | None:
        if self.cache is None:
            return None
        s = self.settings
        settings = {"knobs": knobs, "limit_bytes": limit, "min_batch_size": s.min_batch_size,
                    "max_batch_size": s.max_batch_size, "auto_adjust": s.auto_adjust, "steps": s.steps,
                    "strategy": s.strategy, "max_trials": self._max_trials()}  # fmt: skip
        return CachedSearch.make(self.cache, workload, dev, settings)

    def _max_trials(self) -> int | None:
        if self.settings.max_trials is None and self.settings.strategy == "grow":
            return SEED_GROW_MAX_TRIALS
        return self.settings.max_trials

    def _search(self, knobs: dict[str, Any], workload: Workload, dev: Any, limit: int | None,
                record: dict[str, Any]) -> SearchResult:  # fmt: skip
        s = self.settings
        if not s.auto_adjust:
            s.log(f"Checking the fixed batch size {s.max_batch_size} for {describe(knobs)}...")
            return self._run_search(workload, dev, "binary", s.max_batch_size, knobs)
        guess, source = self._estimate(knobs, workload, dev, limit)
        start = None if guess is None else min(max(guess, s.min_batch_size), s.max_batch_size or guess)
        record.update({"estimated": guess, "estimate_source": source, "starting_with": start})
        s.log(f"Finding optimal batch size for {describe(knobs)} (estimated: {guess}, starting with: {start})...")
        return self._run_search(workload, dev, self._strategy(start), s.min_batch_size, knobs)

    def _run_search(self, workload: Workload, dev: Any, strategy: str | Strategy, lowest: int,
                    knobs: dict[str, Any]) -> SearchResult:  # fmt: skip
        s, label, tried = self.settings, describe(knobs), []

        def starting(batch_size: int) -> None:
            if tried:
                s.log(f"  Trying {'larger' if batch_size > tried[-1] else 'smaller'} batch size: {batch_size}...")
            tried.append(batch_size)

        def finished(trial: Trial) -> None:
            s.log(_trial_line(trial, label, dev.capacity_bytes()))

        return search(workload, device=dev, min_batch_size=lowest, max_batch_size=s.max_batch_size,
                      strategy=strategy, margin=s.margin, max_trials=self._max_trials(), steps=s.steps,
                      on_trial=finished, on_trial_start=starting, trace=False)  # fmt: skip

    def _strategy(self, start: int | None) -> Strategy:
        name = self.settings.strategy
        if name == "auto":
            return Auto(guess=start)
        if name == "grow":
            return Grow(start=start)
        if name == "halving":
            return Halving(start=start)
        return make_strategy(name)

    def _estimate(self, knobs: dict[str, Any], workload: Workload, dev: Any,
                  limit: int | None) -> tuple[int | None, str | None]:  # fmt: skip
        """The first estimate the sources in ``settings.estimate`` give, and which one gave it."""
        s = self.settings
        for source in s.estimate:
            guess = None
            if source == "model" and limit is not None:
                model = CrossConfigModel.fit(self._measured(workload.mode, limit))
                guess = model.predict_batch_size(knobs, limit) if model is not None else None
            elif source == "trace" and limit is not None and not getattr(dev, "traces", False):
                traced = _trace_guess(workload, dev, limit, (s.min_batch_size, s.max_batch_size), s.steps)
                guess = traced["batch_size"] if traced is not None else None
            elif source == "rules" and s.rules is not None:
                guess = s.rules.estimate(knobs, s.max_batch_size)
            if guess is not None:
                return guess, source
        return None, None

    def _measured(self, mode: str, limit: int) -> list[MeasuredConfig]:
        assert self.file is not None
        names = self.file.knob_names
        return [MeasuredConfig({k: r[k] for k in names}, r["batch_size_used"], r["peak_bytes"], r["held_bytes"])
                for r in self.file.records.values()
                if r.get("batch_size_used") and r.get("peak_bytes") and r.get("held_bytes") is not None
                and r.get("limit_bytes") == limit and r.get("mode") == mode and r.get("fits", True)]  # fmt: skip


def _trial_line(trial: Trial, label: str, capacity_bytes: int | None) -> str:
    if trial.fits:
        of = f" of {format_bytes(capacity_bytes)}" if capacity_bytes else ""
        return f"✓ Batch size {trial.batch_size} works for {label} — peak {format_bytes(trial.peak_bytes)}{of}"
    reason = f"caused OOM (in {trial.failed_phase})" if trial.oom else f"does not fit ({trial.error})"
    return f"✗ Batch size {trial.batch_size} {reason} for {label}"


def _result_fields(result: SearchResult, limit: int | None, seconds: float) -> dict[str, Any]:
    return {"batch_size_used": result.batch_size, "fits": True, "exact": result.exact, "strategy": result.strategy,
            "peak_bytes": result.peak_bytes, "held_bytes": result.held_bytes, "limit_bytes": limit,
            "seconds": seconds, "trials": [t.to_dict() for t in result.trials],
            "cached": bool(result.cached)}  # fmt: skip


def _merge(record: dict[str, Any], measured: Any) -> None:
    """A mapping's entries join the record (seed 002's ``"accuracy": 0.85``); anything else is ``result``."""
    if not isinstance(measured, Mapping):
        record["result"] = measured
        return
    clash = [key for key in measured if key in record]
    if clash:
        raise ValueError(f"measure returned {clash}, which the record already has: rename them")
    record.update(measured)


def sweep(
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
) -> SweepResult:
    """The largest batch of every configuration of ``grid``: ``factory(**knobs)`` builds each one's
    ``Workload`` (any mode: ``train``, ``eval``, ``generate``).

    ``max_batch_size`` is the upper limit (seed 002's ``--batch_size``); with ``auto_adjust=False``
    it is the one size used, checked once per configuration. The search starts from the first
    estimate that ``estimate`` names: ``"model"`` (fitted across the configurations measured so
    far), ``"trace"`` (fake tensors) or ``"rules"`` (``rules``: a ``ScaleRules``, a dict or a
    .json/.toml file). ``strategy`` is ``auto`` (default) or a seed's, e.g. ``grow`` (x1.5 up,
    then bisect; at most 5 trials unless ``max_trials``). Records are written to ``results_path``
    after every configuration (atomically), and a re-run with the same path measures only what is
    missing. ``measure(knobs, batch_size, workload)`` runs the real measurement with the batch found;
    a dict it returns joins the record. ``cache`` (default on) answers configurations searched
    before with zero trials. ``log`` receives seed 002's log lines (default: the ``batchfit`` logger).

    >>> import batchfit as bf
    >>> from batchfit.examples import gpt_tiny
    >>> result = sweep(gpt_tiny, {"seq_len": [16, 32]}, device="sim:32MiB", cache=False)
    >>> [r["batch_size_used"] for r in result.records], result.total_trials
    ([71, 35], 4)
    """
    configs = grid_configs(grid)
    unknown = [source for source in estimate if source not in ESTIMATE_SOURCES]
    if unknown:
        raise ValueError(f"unknown estimate source(s) {unknown}: choose from {', '.join(ESTIMATE_SOURCES)}")
    if not auto_adjust and max_batch_size is None:
        raise ValueError("auto_adjust=False uses one fixed size: give it as max_batch_size (--batch-size)")
    make_strategy(strategy)  # an unknown name fails here, naming the strategies
    if isinstance(rules, (str, Path)):
        rules = ScaleRules.load(rules)
    elif isinstance(rules, Mapping):
        rules = ScaleRules.from_dict(rules)
    settings = _Settings(max_batch_size, min_batch_size, auto_adjust, strategy, tuple(estimate), rules, margin,
                         max_trials, steps, log or logger.info)  # fmt: skip
    label = name or getattr(factory, "__name__", "workload")
    return _Sweep(factory, device, settings, cache, measure).run(configs, results_path, label)
