"""SearchResult: the answer of a search and every trial that led to it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch

from batchfit.devices.units import format_bytes
from batchfit.search.allocator_report import allocator_clause
from batchfit.search.trial import Trial


@dataclass
class SearchResult:
    """The largest batch size that fitted in a trial, with the trials that found it.

    ``min_batch_size`` and ``max_batch_size`` are the caller's bounds on the sizes tried
    (``max_batch_size=None``: no cap given); ``upper_bound`` is the largest size the search would
    consider. ``exact`` is true when the edge is confirmed: ``batch_size + 1`` failed, or
    ``batch_size`` is ``upper_bound``. It is false only when ``max_trials`` or ``max_seconds``
    stopped the search early (``extra["stopped_by"]`` names which).

    >>> result = SearchResult(batch_size=24, trials=[Trial(24, True, 900, 0.1), Trial(25, False, None, 0.1)],
    ...     strategy="binary", capacity_bytes=1000, limit_bytes=1000, device="sim:1000B", min_batch_size=1,
    ...     max_batch_size=None, upper_bound=100, exact=True, seconds=0.2)
    >>> result.to_dict()["upper_bound"], result.peak_bytes
    (100, 900)
    """

    batch_size: int
    trials: list[Trial]
    strategy: str
    capacity_bytes: int | None
    limit_bytes: int | None
    device: str
    min_batch_size: int
    max_batch_size: int | None
    """The caller's cap on the sizes tried, ``None`` when none was given."""
    upper_bound: int
    """The largest size the search would consider: the caller's cap, or else the free memory over
    one sample's bytes (no batch larger than that can fit: the batch alone would not)."""
    exact: bool
    seconds: float
    workload: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int | None:
        """The peak measured at the chosen batch size (for a cached result, when it was measured)."""
        return self._at_answer("peak_bytes")

    @property
    def held_bytes(self) -> int | None:
        """What was held before the batch at the chosen size (parameters, buffers, optimizer state)."""
        return self._at_answer("held_bytes")

    def _at_answer(self, field: str) -> int | None:
        """``field`` of the trial that fitted at the answer, else what the cache stored of it."""
        chosen = next((t for t in self.trials if t.batch_size == self.batch_size and t.fits), None)
        measured = getattr(chosen, field) if chosen is not None else None
        return measured if measured is not None else self.cached.get(field)

    @property
    def cached(self) -> dict[str, Any]:
        """Where a result from the cache came from (empty when trials ran now)."""
        cache = self.extra.get("cache") or {}
        return cache if cache.get("hit") else {}

    @property
    def oom_trials(self) -> int:
        """Trials that ran out of memory (not those whose peak only passed the usable bytes)."""
        return sum(1 for t in self.trials if t.oom)

    @property
    def steps(self) -> int:
        """Full training steps executed across all trials."""
        return sum(t.steps for t in self.trials)

    def summary(self) -> str:
        """One sentence with the answer."""
        stopped_by = self.extra.get("stopped_by", "max_trials")
        exact = "" if self.exact else f" (stopped early by {stopped_by}: the edge is not confirmed)"
        if self.cached:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.cached["created"]))
            return (
                f"Largest batch size that fits on {self.device}: {self.batch_size} "
                f"(peak {format_bytes(self.peak_bytes)} of {format_bytes(self.capacity_bytes)}), from the result cache: "
                f"no trials run now (found by '{self.strategy}' in {self.cached['trials']} trials on {when}; "
                f"--no-cache measures again){exact}."
            )
        traced, lines = self.extra.get("trace") or {}, self.extra.get("lines") or {}
        after = f" after a trace estimate of {traced['batch_size']}" if traced.get("batch_size") else ""
        if lines:
            sizes = " and ".join(str(size) for size in lines["from"])
            after = f" (the lines of the trials at {sizes} put the edge at {lines['batch_size']})"
        mode = f" per rank ({self.extra['mode']})" if self.extra.get("mode") else ""
        return (
            f"Largest batch size that fits on {self.device}: {self.batch_size}{mode} "
            f"(peak {format_bytes(self.peak_bytes)} of {format_bytes(self.capacity_bytes)}), "
            f"found by '{self.strategy}' in {len(self.trials)} trials{after}, {self.oom_trials} out of memory, "
            f"{self.seconds:.1f} s{exact}{self._evidence_clause()}{allocator_clause(self.extra)}."
        )

    def _evidence_clause(self) -> str:
        """Why ``auto`` traced first or not, when it chose (``extra["evidence"]``)."""
        choice = self.extra.get("evidence")
        if not choice:
            return ""
        return f"; {'traced' if choice['trace_first'] else 'no trace'}: {choice['reason']}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the answer, the search settings and every trial; it validates
        against ``batchfit/search/schemas/search_result.schema.json``."""
        return {
            "batch_size": self.batch_size,
            "exact": self.exact,
            "strategy": self.strategy,
            "device": self.device,
            "workload": self.workload,
            "capacity_bytes": self.capacity_bytes,
            "limit_bytes": self.limit_bytes,
            "peak_bytes": self.peak_bytes,
            "held_bytes": self.held_bytes,
            "min_batch_size": self.min_batch_size,
            "max_batch_size": self.max_batch_size,
            "upper_bound": self.upper_bound,
            "seconds": self.seconds,
            "oom_trials": self.oom_trials,
            "steps": self.steps,
            "trials": [t.to_dict() for t in self.trials],
            "torch_version": torch.__version__,
            **self.extra,
        }
