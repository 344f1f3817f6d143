"""ConfigSearch: one configuration of a sweep, from the result cache, a fixed size, or a search from an
estimate, as the record the results file keeps. The sequential sweep runs it in its own process; an engine
(``batchfit.sweep.engines``) runs it in a fresh process per configuration, where the driver keeps the cache's
writes (``defer_store``) and the records measured so far come with the job."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfit.devices.resolve import resolve_device
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.errors import NoBatchFitsError
from batchfit.search import distributed
from batchfit.search.backend import TORCH
from batchfit.search.cache import ResultCache
from batchfit.search.cached import CachedSearch
from batchfit.search.result import SearchResult
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.runner import trace_estimate
from batchfit.search.runner import usable_bytes
from batchfit.search.settings import SearchSettings
from batchfit.search.strategies import Auto
from batchfit.search.strategies import Grow
from batchfit.search.strategies import Halving
from batchfit.search.strategies import Strategy
from batchfit.search.strategies import make_strategy
from batchfit.search.trial import Trial
from batchfit.step.workload import Workload
from batchfit.sweep.crossconfig import CrossConfigModel
from batchfit.sweep.crossconfig import MeasuredConfig
from batchfit.sweep.results import describe
from batchfit.sweep.rules import ScaleRules

logger = logging.getLogger("batchfit")

GROW_MAX_TRIALS = 5  # estimate-then-grow gives up after 5 attempts
Measure = Callable[[dict[str, Any], int, Workload], Any]


@dataclass(frozen=True)
class SweepSettings:
    """How a sweep runs: each configuration's search (``search``; the sweep gives each its own start and
    traces through its ``estimate`` sources, never inside the search), and the sweep's own choices."""

    search: SearchSettings
    auto_adjust: bool
    estimate: tuple[str, ...]
    rules: ScaleRules | None
    log: Callable[[str], None]

    def header(self) -> dict[str, Any]:
        """The settings a results file records, and a re-run must share to resume from it."""
        return {
            "max_batch_size": self.search.max_batch_size,
            "min_batch_size": self.search.min_batch_size,
            "auto_adjust": self.auto_adjust,
            "margin": str(self.search.margin),
            "steps": self.search.steps,
        }


def build_workload(factory: Callable[..., Any], knobs: Mapping[str, Any]) -> Workload:
    """``factory(**knobs)``, which must be a ``Workload`` (an ``InputTypeError`` naming the configuration)."""
    workload = factory(**knobs)
    if not isinstance(workload, Workload):
        raise InputTypeError(
            f"the sweep's factory returned {type(workload).__name__} for {describe(knobs)}, not a Workload"
        )
    return workload


@dataclass
class PendingStore:
    """A cache entry a worker found and its driver writes: the key, the result and what the key was made from."""

    key: str
    result: dict[str, Any]
    label: str
    device: str
    fields: dict[str, Any]

    def write(self, cache: ResultCache) -> None:
        cache.put(self.key, self.result, label=self.label, device=self.device, fields=self.fields)


class ConfigSearch:
    """Searches configurations one at a time on ``device`` (``run``), each from its estimate; a record per
    configuration. ``records`` are the configurations measured so far (the memory model fitted across them
    gives the next one's start). With ``defer_store`` the cache is only read, and what it would store is
    kept in ``pending`` for the process that writes it."""

    def __init__(
        self,
        device: DeviceSpec,
        settings: SweepSettings,
        cache: ResultCache | None,
        measure: Measure | None,
        *,
        knob_names: list[str],
        defer_store: bool = False,
    ):
        self.device, self.settings, self.cache, self.measure = device, settings, cache, measure
        self.knob_names, self.defer_store = knob_names, defer_store
        self.pending: list[PendingStore] = []
        self.agreeing = distributed.active()

    def run(self, knobs: dict[str, Any], workload: Workload, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Search one configuration (or take it from the cache) and run ``measure`` on the answer."""
        return self._one(knobs, workload, records)

    def _one(self, knobs: dict[str, Any], workload: Workload, records: list[dict[str, Any]]) -> dict[str, Any]:
        log, label = self.settings.log, describe(knobs)
        log(f"Testing {label}")
        started = time.perf_counter()
        dev = resolve_device(self.device, workload.model)
        limit = usable_bytes(dev, self.settings.search.margin)[1]
        place = self._place(workload, dev, limit, knobs)
        record: dict[str, Any] = {**knobs, "mode": workload.mode}
        result = self._agreed_hit(place.lookup(started) if place is not None else None)
        try:
            if result is None:
                result = self._search(knobs, workload, dev, limit, record, records)
                if place is not None:
                    self._store(place, result)
        except NoBatchFitsError as error:
            log(f"✗ No batch size fits for {label}: {error}")
            used = None if self.settings.auto_adjust else self.settings.search.max_batch_size  # fixed: used anyway
            return {**record, **_failure_fields(error, used, limit, time.perf_counter() - started)}
        record.update(_result_fields(result, limit, time.perf_counter() - started))
        log(
            f"Using batch size: {result.batch_size} for {label}"
            + (" (from the result cache, no trials)" if result.cached else "")
        )
        if self.measure is not None:
            log(f"Measuring {label} with batch size {result.batch_size}...")
            _merge(record, self.measure(dict(knobs), result.batch_size, workload))
        return record

    def _agreed_hit(self, result: SearchResult | None) -> SearchResult | None:
        """A cached answer, used across ranks only when every rank has the same one."""
        if not self.agreeing:
            return result
        size = result.batch_size if result is not None else 0
        same = distributed.agree_min(size) == -distributed.agree_min(-size)
        return result if result is not None and same else None

    def _place(self, workload: Workload, dev: Any, limit: int | None, knobs: dict[str, Any]) -> CachedSearch | None:
        if self.cache is None:
            return None
        s = self.settings
        settings = {
            "knobs": knobs,
            "limit_bytes": limit,
            "min_batch_size": s.search.min_batch_size,
            "max_batch_size": s.search.max_batch_size,
            "auto_adjust": s.auto_adjust,
            "steps": s.search.steps,
            "strategy": s.search.strategy,
            "max_trials": self._max_trials(),
        }
        return CachedSearch.make(self.cache, workload, dev, settings)

    def _max_trials(self) -> int | None:
        if self.settings.search.max_trials is None and self.settings.search.strategy == "grow":
            return GROW_MAX_TRIALS
        return self.settings.search.max_trials

    def _store(self, place: CachedSearch, result: SearchResult) -> None:
        if not self.defer_store:
            place.store(result)
            return
        entry = PendingStore(place.key, result.to_dict(), place.label, result.device, place.fields)
        self.pending.append(entry)

    def _search(
        self,
        knobs: dict[str, Any],
        workload: Workload,
        dev: Any,
        limit: int | None,
        record: dict[str, Any],
        records: list[dict[str, Any]],
    ) -> SearchResult:
        s = self.settings
        if not s.auto_adjust:
            s.log(f"Checking the fixed batch size {s.search.max_batch_size} for {describe(knobs)}...")
            return self._run_search(workload, dev, "binary", s.search.max_batch_size, knobs)
        guess, source = self._estimate(knobs, workload, dev, limit, records)
        start = None if guess is None else min(max(guess, s.search.min_batch_size), s.search.max_batch_size or guess)
        if self.agreeing:  # every rank starts where the tightest one would
            start = distributed.agree_min(start or 0) or None
        record.update({"estimated": guess, "estimate_source": source, "starting_with": start})
        s.log(f"Finding optimal batch size for {describe(knobs)} (estimated: {guess}, starting with: {start})...")
        return self._run_search(workload, dev, self._strategy(start), s.search.min_batch_size, knobs)

    def _run_search(
        self, workload: Workload, dev: Any, strategy: str | Strategy, lowest: int, knobs: dict[str, Any]
    ) -> SearchResult:
        s, label, tried = self.settings, describe(knobs), []

        def starting(batch_size: int) -> None:
            if tried:
                s.log(f"  Trying {'larger' if batch_size > tried[-1] else 'smaller'} batch size: {batch_size}...")
            tried.append(batch_size)

        def finished(trial: Trial) -> None:
            s.log(_trial_line(trial, label, dev.capacity_bytes()))

        search = s.search.replace(min_batch_size=lowest, strategy=strategy, max_trials=self._max_trials())
        return search_workload(workload, search, device=dev, on_trial=finished, on_trial_start=starting)

    def _strategy(self, start: int | None) -> Strategy:
        name = self.settings.search.strategy
        if name == "auto":
            return Auto(guess=start)
        if name == "grow":
            return Grow(start=start)
        if name == "halving":
            return Halving(start=start)
        return make_strategy(name)

    def _estimate(
        self, knobs: dict[str, Any], workload: Workload, dev: Any, limit: int | None, records: list[dict[str, Any]]
    ) -> tuple[int | None, str | None]:
        """The first estimate the sources in ``settings.estimate`` give, and which one gave it."""
        s = self.settings
        for source in s.estimate:
            guess = None
            if source == "model" and limit is not None:
                model = CrossConfigModel.fit(self._measured(records, workload.mode, limit))
                guess = model.predict_batch_size(knobs, limit) if model is not None else None
            elif source == "trace" and limit is not None and not TORCH.is_trace(dev):
                traced = trace_estimate(
                    workload, dev, limit, (s.search.min_batch_size, s.search.max_batch_size), s.search.steps
                )
                guess = traced["batch_size"] if traced is not None else None
            elif source == "rules" and s.rules is not None:
                guess = s.rules.estimate(knobs, s.search.max_batch_size)
            if guess is not None:
                return guess, source
        return None, None

    def _measured(self, records: list[dict[str, Any]], mode: str, limit: int) -> list[MeasuredConfig]:
        names = self.knob_names
        return [
            MeasuredConfig({k: r[k] for k in names}, r["batch_size_used"], r["peak_bytes"], r["held_bytes"])
            for r in records
            if r.get("batch_size_used")
            and r.get("peak_bytes")
            and r.get("held_bytes") is not None
            and r.get("limit_bytes") == limit
            and r.get("mode") == mode
            and r.get("fits", True)
        ]


def _trial_line(trial: Trial, label: str, capacity_bytes: int | None) -> str:
    if trial.fits:
        of = f" of {format_bytes(capacity_bytes)}" if capacity_bytes else ""
        return f"✓ Batch size {trial.batch_size} works for {label} — peak {format_bytes(trial.peak_bytes)}{of}"
    reason = f"caused OOM (in {trial.failed_phase})" if trial.oom else f"does not fit ({trial.error})"
    return f"✗ Batch size {trial.batch_size} {reason} for {label}"


def _result_fields(result: SearchResult, limit: int | None, seconds: float) -> dict[str, Any]:
    return {
        "batch_size_used": result.batch_size,
        "fits": True,
        "exact": result.exact,
        "strategy": result.strategy,
        "peak_bytes": result.peak_bytes,
        "held_bytes": result.held_bytes,
        "limit_bytes": limit,
        "seconds": seconds,
        "trials": [t.to_dict() for t in result.trials],
        "cached": bool(result.cached),
    }


def _failure_fields(error: NoBatchFitsError, used: int | None, limit: int | None, seconds: float) -> dict[str, Any]:
    return {
        "batch_size_used": used,
        "fits": False,
        "error": str(error),
        "limit_bytes": limit,
        "trials": [t.to_dict() for t in error.trials],
        "seconds": seconds,
    }


def _merge(record: dict[str, Any], measured: Any) -> None:
    """A mapping's entries join the record (e.g. ``"accuracy": 0.85``); anything else is ``result``."""
    if not isinstance(measured, Mapping):
        record["result"] = measured
        return
    clash = [key for key in measured if key in record]
    if clash:
        raise InputError(f"measure returned {clash}, which the record already has: rename them")
    record.update(measured)
