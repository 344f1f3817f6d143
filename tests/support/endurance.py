"""Endurance: many consecutive searches in one process must not grow device or process memory.

Each workload gets one ``SimulatedDevice`` for the whole run, so whatever a search leaves alive
stays counted. After every search the device's live bytes are compared with the workload's
baseline (what it holds before any batch: parameters, buffers, grads, optimizer state and the
sample) with no extra garbage collection, and the process's resident memory is read from
``/proc/self/statm`` (the peak from ``getrusage`` where there is no ``/proc``).
"""

from __future__ import annotations

import gc
import os
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import batchfit as bf
from batchfit.search.prober import Prober
from fault_injection import train_a_little
from models import Case
from reliability_campaign import METHODS
from reliability_campaign import linear_scan

TRACE_EVERY = 25  # about one search in this many is the default `auto` with its trace (slow: ~1 s on these models)


def rss_bytes() -> int:
    """The process's resident memory now (its peak where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class _Bench:
    case: Case
    work: bf.Workload
    device: bf.SimulatedDevice
    baseline_bytes: int
    edge: int


def _bench(case: Case, seed: int) -> _Bench:
    work = case.build()
    train_a_little(work, random.Random(seed))
    device = bf.SimulatedDevice(case.capacity)
    with Prober(work, device) as prober:
        baseline = prober.baseline_bytes
    return _Bench(case, work, device, baseline, linear_scan(work, case.capacity))


@dataclass
class Endurance:
    """Per search: the method, the bytes above baseline left on its device, the RSS, right or not."""

    methods: list[str] = field(default_factory=list)
    extra_live_bytes: list[int] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)  # indices of searches that missed the edge
    objects: list[tuple[int, int]] = field(default_factory=list)  # (search index, gc-tracked objects)
    seconds: float = 0.0

    def figures(self, warmup: int) -> dict[str, Any]:
        """RSS growth is measured from the end of the ``warmup`` searches (allocator pools and
        torch's caches fill during the first ones) to the highest value after it."""
        steady = self.rss_bytes[warmup:] or self.rss_bytes
        return {
            "searches": len(self.methods),
            "wrong_edges": len(self.wrong),
            "max_extra_live_bytes": max(self.extra_live_bytes, default=0),
            "searches_with_extra_live_bytes": sum(b != 0 for b in self.extra_live_bytes),
            "rss_start_mib": self.rss_bytes[0] / 2**20,
            "rss_after_warmup_mib": steady[0] / 2**20,
            "rss_end_mib": self.rss_bytes[-1] / 2**20,
            "rss_growth_after_warmup_mib": (max(steady) - steady[0]) / 2**20,
            "objects": self.objects,
            "object_growth_after_warmup": self.objects[-1][1] - self.objects[-2][1] if len(self.objects) > 2 else None,
            "seconds": self.seconds,
            "seconds_per_search": self.seconds / max(1, len(self.methods)),
        }


def _count_objects(run: Endurance, index: int) -> None:
    gc.collect()
    run.objects.append((index, len(gc.get_objects())))


def run_endurance(
    count: int,
    cases: list[Case],
    *,
    warmup: int,
    seed: int = 0,
    progress: Callable[[int, Endurance], None] | None = None,
) -> Endurance:
    """``count`` searches, rotating over ``cases`` and, for each, over the methods, with the traced
    ``auto`` twice in each cycle of ``TRACE_EVERY + 1``. Python's gc-tracked objects are counted
    before the first search, after ``warmup`` searches and after the last."""
    benches = [_bench(case, seed + i) for i, case in enumerate(cases)]
    plain = [m for m in METHODS if not m[2]]
    # Each workload's own searches cycle through the methods with the traced `auto` twice: first, because torch
    # fills its fake-tensor dispatch cache on a workload's first trace and the warm-up (however short) must hold
    # that, or the cache's growth would read as a leak; and mid-cycle, so a short run past its warm-up traces too.
    traced = next(m for m in METHODS if m[2])
    cycle = [plain[i % len(plain)] for i in range(TRACE_EVERY - 1)]
    cycle.insert(TRACE_EVERY // 2, traced)
    cycle.insert(0, traced)
    run = Endurance()
    _count_objects(run, 0)
    start = time.perf_counter()
    for index in range(count):
        if index == warmup:
            _count_objects(run, index)
        bench = benches[index % len(benches)]
        label, strategy, trace = cycle[(index // len(benches)) % len(cycle)]
        result = bf.search_workload(bench.work, device=bench.device, strategy=strategy, trace=trace)
        run.methods.append(label)
        run.extra_live_bytes.append(bench.device.live_bytes() - bench.baseline_bytes)
        run.rss_bytes.append(rss_bytes())
        if result.batch_size != bench.edge or not result.exact:
            run.wrong.append(index)
        if progress is not None:
            progress(index, run)
    run.seconds = time.perf_counter() - start
    _count_objects(run, count)
    return run
