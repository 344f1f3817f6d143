"""The result cache around a search: look the fingerprint up first, store the answer after."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit.devices.base import Device
from batchfit.errors import InputTypeError
from batchfit.search.cache import CacheEntry
from batchfit.search.cache import ResultCache
from batchfit.search.fingerprint import NotFingerprintable
from batchfit.search.fingerprint import fingerprint
from batchfit.search.fingerprint import fingerprint_fields
from batchfit.search.result import SearchResult
from batchfit.step.workload import Workload

logger = logging.getLogger("batchfit")

CacheSpec = ResultCache | bool | str | Path | None


def open_cache(cache: CacheSpec) -> ResultCache | None:
    """``False``/``None``: no cache; ``True``: the default folder; a path: that folder. A folder that
    is a file (or a link to one) is one warning and no cache: a cache never stops a search."""
    if cache is None or cache is False:
        return None
    if isinstance(cache, ResultCache):
        return cache
    check_cache(cache)
    try:
        return ResultCache(None if cache is True else cache)
    except ValueError as error:  # a file where the folder should be: the search runs, uncached (never stops)
        logger.warning("batchfit: %s; caching is off for this run", error)
        return None


def check_cache(cache: Any) -> None:
    """A ``TypeError`` unless ``cache`` is ``True``, ``False``, ``None``, a folder or a ``ResultCache``."""
    if cache is not None and not isinstance(cache, (bool, str, Path, ResultCache)):
        raise InputTypeError(f"cache must be True, False, a folder or a ResultCache, got {type(cache).__name__}")


@dataclass
class CachedSearch:
    """One search's place in the cache: its key and the fields the key was made from."""

    cache: ResultCache
    key: str
    fields: dict[str, Any]
    label: str

    @classmethod
    def make(
        cls, cache: ResultCache, workload: Workload, device: Device, settings: Mapping[str, Any]
    ) -> CachedSearch | None:
        """The search's place in ``cache``, or ``None`` (one warning: the search runs uncached) when
        its loss or step sees a value the fingerprint cannot represent: a wrong answer is worse than none."""
        try:
            fields = fingerprint_fields(workload, device, settings)
        except NotFingerprintable as error:
            logger.warning("batchfit: %s", error)
            return None
        knobs = settings.get("knobs") or {}
        label = " ".join([workload.name or "workload", *(f"{k}={v}" for k, v in knobs.items())])
        return cls(cache, fingerprint(fields), fields, label)

    def lookup(self, started: float) -> SearchResult | None:
        """The stored answer as a result with zero trials, or ``None``."""
        entry = self.cache.get(self.key)
        if entry is None:
            return None
        try:
            result = from_entry(entry, time.perf_counter() - started, self.cache)
        except (KeyError, TypeError):  # stored by a build that wrote other fields: measure again
            return None
        logger.info("Batch size %s for %s from the result cache (no trials run)", result.batch_size, self.label)
        return result

    def store(self, result: SearchResult) -> None:
        self.cache.put(self.key, result.to_dict(), label=self.label, device=result.device, fields=self.fields)
        result.extra["cache"] = {"hit": False, "path": str(self.cache.path), "key": self.key}


def from_entry(entry: CacheEntry, seconds: float, cache: ResultCache) -> SearchResult:
    """A stored result: the same answer, no trials, and where it came from in ``extra["cache"]``."""
    stored = entry.result
    cached = {
        "hit": True,
        "held_bytes": stored.get("held_bytes"),
        "path": str(cache.path),
        "key": entry.key,
        "created": entry.created,
        "trials": len(stored.get("trials", [])),
        "peak_bytes": stored.get("peak_bytes"),
        "seconds": stored.get("seconds"),
    }
    extra = {k: v for k, v in stored.items() if k == "trace"}
    return SearchResult(
        batch_size=stored["batch_size"],
        trials=[],
        strategy=stored["strategy"],
        capacity_bytes=stored["capacity_bytes"],
        limit_bytes=stored["limit_bytes"],
        device=stored["device"],
        min_batch_size=stored["min_batch_size"],
        max_batch_size=stored["max_batch_size"],
        upper_bound=stored["upper_bound"],  # missing in an entry stored by an older build: measured again
        exact=stored["exact"],
        seconds=seconds,
        workload=stored.get("workload"),
        extra={**extra, "cache": cached},
    )
