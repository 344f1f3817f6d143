"""The largest budget that holds for a whole run, not for one step from an emptied cache: each shape's requests
logged by one trial on the device, then the run replayed through its caching allocator model
(``batchfit.devices.allocator_soak``) at every budget the bisection tries, beside the same with expandable
segments. ``soak_batch_size`` answers for fixed shapes (``find``); ``batchfit.tokens.soak`` for lengths drawn from
the data.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.bounds import check_size
from batchfit.devices.allocator_soak import Soak
from batchfit.devices.allocator_soak import SoakPlan
from batchfit.devices.allocator_soak import StepLog
from batchfit.devices.allocator_soak import soak
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.search.backend import backend_for
from batchfit.search.prober import Prober
from batchfit.search.result import SearchResult
from batchfit.search.runner import prepared_for
from batchfit.search.runner import usable_bytes
from batchfit.search.soak_result import SoakedBudget

DEFAULT_SOAK_STEPS = 1000
MOST_SOAK_STEPS = 100_000  # ten times a long soak: past it, the replay alone takes minutes per budget


@dataclass(frozen=True)
class SoakSettings:
    """How a soak runs: ``steps`` training steps; an evaluation pass of ``eval_steps`` batches after every
    ``eval_every_steps`` (``None``: none); lengths drawn with ``seed``.

    >>> SoakSettings(steps=0)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: soak steps must be at least 1, got 0
    """

    steps: int = DEFAULT_SOAK_STEPS
    eval_every_steps: int | None = None
    eval_steps: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check_size("soak steps", self.steps, largest=MOST_SOAK_STEPS)
        if self.eval_every_steps is not None:
            check_size("eval_every_steps (steps between evaluation passes)", self.eval_every_steps)
        check_size("eval_steps (batches per evaluation pass)", self.eval_steps, largest=MOST_SOAK_STEPS)
        check_size("seed", self.seed, smallest=0)


def log_step(workload: Any, device: Any, batch_size: int) -> StepLog | None:
    """One trial of two steps of ``workload`` at ``batch_size`` on ``device`` (which models the caching allocator),
    its requests cut into a ``StepLog``; ``None`` where the trial itself ran out of memory (from an emptied cache)."""
    with Prober(prepared_for(backend_for(workload), device, workload), device, steps=2, settle_steps=0) as prober:
        trial = prober.probe(batch_size)
        counter = prober.device.counter
        if not trial.fits:
            return None
        return StepLog.of(
            counter.event_log(), counter.storage_log()[2], counter.step_marks(), counter.allocator_at_start
        )


def check_soak_device(device: Any) -> None:
    """A soak replays the device's caching allocator model: a device that counts exactly, or a real GPU, has none."""
    counter = getattr(device, "counter", None)
    if getattr(counter, "allocator", None) is None:
        raise InputError(
            f"a soak replays the caching allocator model, and {device.name} has none: give a device that models it, "
            "such as sim:8GiB:cuda (SimulatedDevice(capacity, allocator='cuda')) or a GPU preset's trace"
        )


@dataclass
class Soaker:
    """Runs the soak of any budget: ``plan(budget)`` says its steps (shape keys), ``shape(key)`` what a key runs
    (its workload and batch size, for training and for evaluation); each key logged once."""

    device: Any
    limit_bytes: int
    plan: Callable[[int], SoakPlan]
    shape: Callable[[Hashable, str], tuple[Any, int]]
    logs: dict[tuple[Hashable, str], StepLog | None] = field(default_factory=dict)
    log_seconds: float = 0.0
    soak_seconds: float = 0.0

    def log(self, key: Hashable, mode: str) -> StepLog | None:
        if (key, mode) not in self.logs:
            started = time.perf_counter()
            workload, batch_size = self.shape(key, mode)
            self.logs[key, mode] = log_step(workload, self.device, batch_size)
            self.log_seconds += time.perf_counter() - started
        return self.logs[key, mode]

    def run(self, budget: int, expandable: bool = False) -> Soak:
        plan = self.plan(budget)
        train = {key: self.log(key, "train") for key in dict.fromkeys(plan.train)}
        evals = {key: self.log(key, "eval") for key in dict.fromkeys(plan.eval_shapes)} if plan.eval_every_steps else {}
        unlogged = next((key for key, log in (*train.items(), *evals.items()) if log is None), None)
        if unlogged is not None:  # its own trial, from an emptied cache, ran out of memory
            first = next(n for n, key in enumerate(plan.train, 1) if key == unlogged) if unlogged in train else None
            return Soak(False, len(plan.train), (), (), first or 1, unlogged not in train, unlogged)
        start = next(iter(train.values())).start
        if expandable:
            start = _expandable(start)
        started = time.perf_counter()
        outcome = soak(train, plan, self.limit_bytes, start=start, eval_logs=evals)
        self.soak_seconds += time.perf_counter() - started
        return outcome


def _expandable(start: CachingAllocator) -> CachingAllocator:
    """The state a process with ``expandable_segments:True`` would start from, the same blocks held."""
    return start.rebuilt(dataclasses.replace(start.settings, expandable_segments=True))


def largest_holding(candidates: Sequence[int], holds: Callable[[int], bool]) -> int | None:
    """The largest of ascending ``candidates`` that ``holds``, bisecting from the top (the last is tried first);
    ``None`` where not even the first holds. The one above the answer was tried and failed.

    >>> largest_holding([1, 2, 4, 8, 16], lambda budget: budget <= 5)
    4
    """
    if holds(candidates[-1]):
        return candidates[-1]
    low, high = -1, len(candidates) - 1  # candidates[high] fails; candidates[low] holds (-1: none known)
    while high - low > 1:
        middle = (low + high) // 2
        if holds(candidates[middle]):
            low = middle
        else:
            high = middle
    return candidates[low] if low >= 0 else None


def soaked_budget(soaker: Soaker, candidates: Sequence[int], unit: str) -> SoakedBudget:
    """The largest of ``candidates`` (ascending, the last the fresh-cache answer) whose run holds, and the same with
    expandable segments."""
    tried: dict[int, Soak] = {}

    def holds(budget: int) -> bool:
        tried[budget] = soaker.run(budget)
        return tried[budget].served

    budget = largest_holding(candidates, holds)
    expandable_runs: dict[int, Soak] = {}

    def holds_expandable(budget: int) -> bool:
        expandable_runs[budget] = soaker.run(budget, expandable=True)
        return expandable_runs[budget].served

    expandable = largest_holding(candidates, holds_expandable)
    above = next((c for c in candidates if budget is None or c > budget), None)
    return SoakedBudget(
        unit,
        candidates[-1],
        budget,
        tried.get(budget) if budget is not None else None,
        tried.get(above) if above is not None else None,
        above,
        expandable,
        expandable_runs.get(expandable) if expandable is not None else None,
        logged_shapes=len(soaker.logs),
        log_seconds=soaker.log_seconds,
        soak_seconds=soaker.soak_seconds,
        tried={b: run.served for b, run in tried.items()},
        fresh_run=tried[candidates[-1]],
    )


def soak_batch_size(
    workload: Any,
    fresh_batch_size: int,
    settings: SoakSettings | None = None,
    *,
    device: Any,
    margin: int | float | str = 0,
) -> SoakedBudget:
    """The largest batch size, at most ``fresh_batch_size`` (the search's answer), whose run of ``settings.steps``
    steps (every one of this shape, in the loop's own order, an evaluation pass of ``eval_steps`` batches of the same
    size every ``eval_every_steps``) the caching allocator model of ``device`` serves within its capacity less
    ``margin``; beside it, the same with expandable segments.

    >>> import torch
    >>> import batchfit as bf
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    >>> work = bf.Workload(model, (torch.randn(4, 64), torch.randint(0, 10, (4,))),
    ...                    torch.nn.functional.cross_entropy, torch.optim.Adam(model.parameters()))
    >>> device = bf.SimulatedDevice("3MiB", allocator="cuda")
    >>> fresh = bf.find_max_batch_size(model, work.sample_batch, loss_fn=work.loss_fn,
    ...                                optimizer=work.optimizer, device=device).batch_size
    >>> soaked = soak_batch_size(work, fresh, SoakSettings(steps=200, eval_every_steps=50), device=device)
    >>> soaked.budget <= soaked.fresh == fresh, soaked.held.steps_run
    (True, 200)
    """
    settings = settings or SoakSettings()
    check_size("fresh_batch_size", fresh_batch_size)
    check_soak_device(device)
    _, limit = usable_bytes(device, margin)
    evaluating = dataclasses.replace(workload, mode="eval", accumulating=False)

    def plan(batch_size: int) -> SoakPlan:
        evals = (batch_size,) * settings.eval_steps if settings.eval_every_steps else ()
        return SoakPlan((batch_size,) * settings.steps, settings.eval_every_steps, evals)

    def shape(batch_size: Hashable, mode: str) -> tuple[Any, int]:
        return (workload if mode == "train" else evaluating), int(batch_size)

    soaker = Soaker(device, limit, plan, shape)
    return soaked_budget(soaker, list(range(1, fresh_batch_size + 1)), "samples per batch")


def soaked_result(
    result: SearchResult, workload: Any, settings: SoakSettings, *, device: Any, margin: int | float | str = 0
) -> SearchResult:
    """``result`` (a search's, from an emptied cache) with the answer that holds for the run of ``settings`` as its
    ``batch_size``; the fresh-cache answer, the runs and the advice in ``extra["soak"]``. ``NoBatchFitsError`` where
    not even the smallest batch holds for the run."""
    soaked = soak_batch_size(workload, result.batch_size, settings, device=device, margin=margin)
    extra = {**result.extra, "soak": soaked.to_dict()}
    if soaked.budget is None:
        raise NoBatchFitsError(
            f"{result.batch_size} fits from an emptied cache, but not even batch size 1 holds for {settings.steps} "
            f"steps: {soaked.advice()}",
            result.trials,
        )
    return dataclasses.replace(result, batch_size=soaked.budget, extra=extra)
