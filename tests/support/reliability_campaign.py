"""The fault-injection campaign, shared by ``tests/project/test_reliability.py`` (reduced) and
``benchmarks/reliability.py`` (full).

For every workload of ``tests/support/models.py`` and ``noisy_mlp`` below (each trained a little first, so
that grads, optimizer state and BatchNorm statistics exist) and every method (``auto`` with and
without the trace, ``binary``, ``power``, ``grow``, ``halving``), a clean search records every op
of its real trials with its phase. Each injection then takes an error kind and a phase in a seeded
rotation and a seeded op of that phase, raises the error there (before or after the op) during the
same search, and checks:

- an OOM (``torch.OutOfMemoryError`` or a CUDA OOM message) fails exactly the trial it struck, and
  every other trial of that search still fits exactly when the linear scan says it does;
- any other error (``RuntimeError``, ``ValueError``, the user's own type, ``KeyboardInterrupt``)
  propagates out of the search as the very same object;
- afterwards the state is bitwise as before (see ``fault_injection.fingerprint``), the device's
  live bytes are back at the baseline, and the next search (``auto``, no trace) finds the true edge.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import batchfit as bf
from batchfit.search.prober import Prober
from fault_injection import KINDS
from fault_injection import Fault
from fault_injection import FaultyDevice
from fault_injection import Injector
from fault_injection import differences
from fault_injection import fingerprint
from fault_injection import phase_hooks
from fault_injection import train_a_little
from models import CASES
from models import Case


def noisy_mlp() -> bf.Workload:
    """A step that draws from every RNG a probe must restore: dropout (torch), and an input
    scale from Python's and NumPy's generators (a user's augmentation)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.2), nn.ReLU(), nn.Linear(64, 4))

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        return F.cross_entropy(model(inputs * scale), targets)

    batch = (torch.randn(3, 16), torch.randint(0, 4, (3,)))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
    return bf.Workload(model, batch, optimizer=optimizer, step_fn=step, name="noisy")


CAMPAIGN_CASES = [*CASES, Case(noisy_mlp, "64KiB")]
# (label, strategy, trace)
METHODS = [
    ("auto", "auto", True),
    ("auto, no trace", "auto", False),
    ("binary", "binary", False),
    ("power", "power", False),
    ("grow", "grow", False),
    ("halving", "halving", False),
]
STRATA = ("forward", "backward", "optimizer", "batch", "any")  # "any": an op drawn from all of them


def linear_scan(work: bf.Workload, capacity: str) -> int:
    """The true edge of ``work`` in its current state: probe 1, 2, 3, ... until the first failure."""
    device = bf.SimulatedDevice(capacity)
    with Prober(work, device, limit_bytes=device.capacity_bytes()) as prober:
        size = 1
        while prober.probe(size).fits:
            size += 1
    return size - 1


@dataclass
class Target:
    """One workload, trained a little, on its own faulty device: its true edge (a linear scan in
    that state), its fingerprint, its baseline bytes, and the ops of each method's clean search."""

    case: Case
    seed: int
    injector: Injector = field(default_factory=Injector)
    ops: dict[str, tuple[list[str], list[bool]]] = field(default_factory=dict)  # method -> (phases, completed)

    def __post_init__(self) -> None:
        self.rebuild()
        self.edge = linear_scan(self.work, self.case.capacity)
        self.setup_differences = differences(self.before, fingerprint(self.work))  # after two batchfit calls

    def rebuild(self) -> None:
        """A fresh workload in a trained state on a fresh device (bytes leaked earlier stay out of
        the new baseline), its fingerprint (taken before batchfit sees it) and its baseline bytes."""
        self.device = FaultyDevice(self.case.capacity, self.injector)
        self.work = self.case.build()
        train_a_little(self.work, random.Random(self.seed))
        self.before = fingerprint(self.work)
        with Prober(self.work, self.device) as prober:
            self.baseline_bytes = prober.baseline_bytes
        gc.collect()

    def search(self, label: str) -> bf.SearchResult:
        _label, strategy, trace = next(m for m in METHODS if m[0] == label)
        return bf.search_workload(self.work, device=self.device, strategy=strategy, trace=trace)

    def record(self, label: str) -> bf.SearchResult:
        self.injector.reset(recording=True)
        result = self.search(label)
        self.ops[label] = (self.injector.labels, self.injector.completed)
        self.injector.reset()
        return result


@dataclass
class Outcome:
    """What one injection did and what it left behind."""

    case: str
    method: str
    kind: str
    stratum: str
    op_index: int
    after: bool
    fired_phase: str | None = None
    batchfit_phase: str | None = None  # the failed trial's phase, for OOMs
    problems: list[str] = field(default_factory=list)  # what went wrong in the search itself
    state_differences: list[str] = field(default_factory=list)
    leaked_bytes: int = 0
    held_by_error_bytes: int = 0  # live while the caller still holds the propagated exception
    edge_after: int | None = None
    wrong_edge_after: bool = False
    seconds: float = 0.0


def fault_plan(seed: int) -> list[tuple[str, str]]:
    """Every (error kind, phase) pair once, in a seeded order."""
    pairs = [(kind, stratum) for kind in KINDS for stratum in STRATA]
    random.Random(seed).shuffle(pairs)
    return pairs


def plan_fault(
    target: Target, label: str, index: int, combos: int, pairs: list[tuple[str, str]], rng: random.Random
) -> tuple[str, Fault]:
    """Injection ``index`` (``combos``: workload x method pairs) takes its kind and phase from
    ``pairs``: with 30 combinations a round uses every pair once, and over rounds each
    combination walks through all of them (a step of 7, coprime with their number). The op (among
    those that completed, when raising after one) and before/after are seeded choices."""
    combo, round_ = index % combos, index // combos
    kind, stratum = pairs[(combo + 7 * round_) % len(pairs)]
    after = rng.random() < 0.5
    phases, completed = target.ops[label]
    candidates = [
        i for i, phase in enumerate(phases) if (stratum == "any" or phase == stratum) and (completed[i] or not after)
    ]
    if not candidates:  # a workload without that phase (none of the campaign's)
        stratum, candidates = "any", [i for i in range(len(phases)) if completed[i] or not after]
    return stratum, Fault(kind, rng.choice(candidates), after, marker=f"[batchfit-injected #{index}]")


def _check_oom_search(outcome: Outcome, fault: Fault, trials: list[bf.Trial], edge: int, stopped: bool) -> None:
    struck = [t for t in trials if t.error and fault.marker in t.error]
    if len(struck) != 1 or struck[0].fits or not struck[0].oom:
        outcome.problems.append(f"the injected OOM did not fail exactly one trial: {len(struck)}")
        return
    outcome.batchfit_phase = struck[0].failed_phase
    misjudged = [t.batch_size for t in trials if t is not struck[0] and t.fits != (t.batch_size <= edge)]
    if misjudged:
        outcome.problems.append(f"trials after the injected OOM misjudged: {misjudged}")
    if stopped and struck[0].batch_size != 1:
        outcome.problems.append(f"NoBatchFitsError although the OOM struck batch size {struck[0].batch_size}")


def inject(target: Target, label: str, stratum: str, fault: Fault) -> Outcome:
    """Run one search with ``fault`` armed, then check what it left behind."""
    outcome = Outcome(target.case.name, label, fault.kind, stratum, fault.op_index, fault.after)
    start = time.perf_counter()
    target.injector.reset(fault)
    try:
        result = target.search(label)
    except bf.NoBatchFitsError as error:  # an OOM struck the smallest size: nothing fitted
        trials, stopped = error.trials, True
        if not fault.is_oom:
            outcome.problems.append(f"a {fault.kind} error became NoBatchFitsError: {str(error)[:120]}")
        del error
    except BaseException as error:  # KeyboardInterrupt included: it must come out unchanged
        trials, stopped = [], True
        if fault.is_oom or error is not fault.error:
            outcome.problems.append(f"{type(error).__name__} came out of the search: {str(error)[:120]}")
        gc.collect()
        outcome.held_by_error_bytes = target.device.live_bytes() - target.baseline_bytes
        del error
    else:
        trials, stopped = result.trials, False
        del result
        if not fault.is_oom:
            outcome.problems.append(f"the search swallowed a {fault.kind} error")
    outcome.fired_phase = target.injector.fired_phase
    target.injector.reset()
    if outcome.fired_phase is None:
        outcome.problems.append("the fault never fired (the search took another path than its clean run)")
    elif fault.is_oom:
        _check_oom_search(outcome, fault, trials, target.edge, stopped)
    fault.error = None
    _check_aftermath(target, outcome)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _check_aftermath(target: Target, outcome: Outcome) -> None:
    gc.collect()
    outcome.leaked_bytes = target.device.live_bytes() - target.baseline_bytes
    outcome.state_differences = differences(target.before, fingerprint(target.work))
    try:
        after = bf.search_workload(target.work, device=target.device, strategy="auto", trace=False)
    except bf.NoBatchFitsError:
        outcome.wrong_edge_after = True
    else:
        outcome.edge_after = after.batch_size
        outcome.wrong_edge_after = after.batch_size != target.edge or not after.exact
    if outcome.state_differences or outcome.leaked_bytes:
        target.rebuild()  # start clean, so one failure is counted once


@dataclass
class Campaign:
    outcomes: list[Outcome] = field(default_factory=list)
    edges: dict[str, int] = field(default_factory=dict)
    clean_problems: list[str] = field(default_factory=list)  # what went wrong without any fault
    seconds: float = 0.0

    def figures(self) -> dict[str, Any]:
        done = self.outcomes
        return {
            "injections": len(done),
            "state_differences": sum(bool(o.state_differences) for o in done),
            "leaks": sum(o.leaked_bytes != 0 for o in done),
            "wrong_edges_after": sum(o.wrong_edge_after for o in done),
            "search_problems": sum(bool(o.problems) for o in done),
            "clean_run_problems": len(self.clean_problems),
            "phase_disagreements": sum(_disagrees(o) for o in done),
            "by_kind": dict(Counter(o.kind for o in done)),
            "by_phase": dict(Counter(o.fired_phase for o in done)),
            "by_method": dict(Counter(o.method for o in done)),
            "by_case": dict(Counter(o.case for o in done)),
            "raised_after_op": sum(o.after for o in done),
            "max_held_by_error_bytes": max((o.held_by_error_bytes for o in done), default=0),
        }

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problems or o.state_differences or o.leaked_bytes or o.wrong_edge_after]


def _disagrees(outcome: Outcome) -> bool:
    """batchfit names a failed trial's phase itself; batch building counts as forward there."""
    if outcome.batchfit_phase is None or outcome.fired_phase is None:
        return False
    expected = "forward" if outcome.fired_phase == "batch" else outcome.fired_phase
    return outcome.batchfit_phase != expected


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Move every object alive now out of the collector's sight (``gc.freeze``), so that the full
    collections batchfit runs after a failed trial, and this harness after each injection, cost
    milliseconds instead of a walk over torch's ~300k objects. Objects made later are collected
    as usual, so a leak made by an injection still shows. Where objects were frozen already (the
    test session freezes what outlives each test: ``tests/conftest.py``), they stay frozen."""
    nested = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not nested:
            gc.unfreeze()


def _clean_run(target: Target, label: str) -> list[str]:
    """Record the ops of a search without a fault; it must find the edge and leave nothing behind."""
    clean = target.record(label)
    gc.collect()
    problems = [f"changed {key}" for key in differences(target.before, fingerprint(target.work))]
    if clean.batch_size != target.edge or not clean.exact:
        problems.append(f"found {clean.batch_size}, not the edge {target.edge}")
    if target.device.live_bytes() != target.baseline_bytes:
        problems.append(f"left {target.device.live_bytes() - target.baseline_bytes} bytes alive")
    return [f"{target.case.name}/{label} without a fault: {problem}" for problem in problems]


def run_campaign(
    count: int,
    *,
    seed: int = 0,
    cases: list[Case] = CAMPAIGN_CASES,
    methods: list[str] | None = None,
    progress: Callable[[Outcome], None] | None = None,
) -> Campaign:
    """``count`` injections spread evenly over ``cases`` x ``methods``, each seeded by ``seed``."""
    labels = methods or [m[0] for m in METHODS]
    campaign = Campaign()
    start = time.perf_counter()
    logging.getLogger("batchfit").setLevel(logging.WARNING)
    combos, pairs = [(c, m) for c in cases for m in labels], fault_plan(seed)
    for case_index, case in enumerate(cases):
        target = Target(case, seed + case_index)
        campaign.edges[case.name] = target.edge
        campaign.clean_problems += [f"{case.name}: the linear scan changed {d}" for d in target.setup_differences]
        with phase_hooks(target.injector), frozen_gc():
            for label in labels:
                campaign.clean_problems += _clean_run(target, label)
            for index in range(count):
                if combos[index % len(combos)][0] is not case:
                    continue
                label = combos[index % len(combos)][1]
                rng = random.Random(f"{seed}/{index}")
                stratum, fault = plan_fault(target, label, index, len(combos), pairs, rng)
                outcome = inject(target, label, stratum, fault)
                campaign.outcomes.append(outcome)
                if progress is not None:
                    progress(outcome)
    campaign.seconds = time.perf_counter() - start
    return campaign
