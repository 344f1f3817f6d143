"""Replay a training loop's requests and frees through the caching allocator model, at any sizes, for as many
steps as it takes the allocator to settle.

A counting device logs, in order, every storage a trial made and freed (``LiveBytes.event_log``), where each step
began and each phase ended (``LiveBytes.step_marks``), and the allocator's state when the trial began
(``LiveBytes.allocator_at_start``). Replaying that order with other sizes (the storages' bytes at another batch
size, drawn as lines through two trials) says whether the card's allocator would serve every request of a step at
that size: fragmentation decides it, so no sum of bytes can.

One step is not enough. The caching allocator carries its cache from one step to the next, so where a step's
blocks land depends on where the last step's landed: a loop can run out of memory at step 2 or step 8 at a size
whose first step was served. A trial's last step is the loop's steady step (the batch copied in while the last
one still lives, the previous output and loss freed in the forward, the optimizer state already there), so the
replay runs it again and again, each time freeing what the step before left alive, until the allocator's state
(``CachingAllocator.state_key``) repeats: from then on every step is served as one already was, for the whole
run. A request it cannot serve on the way names the step of the loop that would run out of memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchfit.devices.caching_allocator import Block
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.devices.loop_orders import LOOP_ORDERS
from batchfit.devices.loop_orders import LoopOrder
from batchfit.devices.loop_orders import reordered

SETTLE_STEPS = 64  # the most steps of the loop replayed after a trial's own before the answer is "held so far"
PHASES = ("forward", "backward", "optimizer")  # the phase marks a trial logs where each phase ends


@dataclass(frozen=True)
class Replay:
    """The outcome: whether every request was served within the capacity, and the peaks on the way.

    With the steps of a loop: ``loop_steps`` steps ran (the trial's own, then its last one again), ``settled``
    says the allocator's state repeated after the last of them (``False``: still changing when the replay
    stopped; ``None``: the steps were not replayed, as when the last step leaves more alive than it frees, a
    loop that keeps something of every step), and where a request failed, ``failed_step`` is the loop's step
    (1 is the first) and ``failed_phase`` the phase it fell in.
    """

    served: bool
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    loop_steps: int = 0
    settled: bool | None = None
    failed_step: int | None = None
    failed_phase: str | None = None
    loop: LoopOrder | None = None  # the loop's order this replay ran (``replay_loops``: the one that failed)


@dataclass(frozen=True)
class StepSpans:
    """Where each step of a trial lies in its event log (``begins[i]:ends[i]``), and where its phases end."""

    begins: tuple[int, ...]
    ends: tuple[int, ...]
    phase_ends: tuple[tuple[int, str], ...]

    @classmethod
    def of(cls, marks: Sequence[tuple[int, str]]) -> StepSpans | None:
        """From ``LiveBytes.step_marks``: ``"step"`` where each step begins, ``"end"`` after the last (``None``
        without both: a trial cut short by an error has no whole steps to replay)."""
        starts = [at for at, label in marks if label == "step"]
        ends = [at for at, label in marks if label == "end"]
        if not starts or not ends:
            return None
        return cls(tuple(starts), (*starts[1:], ends[-1]), tuple((at, label) for at, label in marks if label in PHASES))

    def step_of(self, position: int) -> int:
        """The step (1 is the first) the event at ``position`` belongs to."""
        return int(np.searchsorted(np.array(self.begins), position, side="right"))

    def phase_of(self, position: int) -> str:
        """The phase the event at ``position`` falls in: the first phase that ends after it, within its step."""
        end = self.ends[self.step_of(position) - 1]
        for at, label in self.phase_ends:
            if position < at <= end:
                return label
        return PHASES[-1]


@dataclass(frozen=True)
class SteadyStep:
    """A trial's last step as the loop runs it again: its events, and which storages it frees that an earlier
    step made (``freed_before``) with the ones it leaves alive in their place (``kept``), pair by pair in the
    order they were made (the last batch, output and loss for this step's)."""

    events: list[int]
    freed_before: dict[int, int]  # a storage made before the step -> its partner among ``kept``
    kept: list[int]

    @classmethod
    def of(cls, events: np.ndarray, begin: int, end: int, sizes: np.ndarray) -> SteadyStep | None:
        """The step at ``events[begin:end]``, or ``None`` where it leaves alive what it does not free of the
        steps before it, in number or in size (a loop that keeps something of every step has no steady step)."""
        step = events[begin:end].tolist()
        made = {event - 1 for event in step if event > 0}
        freed = {-event - 1 for event in step if event < 0}
        before = sorted(freed - made)
        kept = sorted(made - freed)
        if len(before) != len(kept) or not np.array_equal(sizes[before], sizes[kept]):
            return None
        return cls(step, dict(zip(before, kept, strict=True)), kept)


def replay(
    start: CachingAllocator,
    events: np.ndarray,
    sizes: np.ndarray,
    capacity_bytes: int | None = None,
    *,
    marks: Sequence[tuple[int, str]] | None = None,
    settle_steps: int = 0,
) -> Replay:
    """Run ``events`` (``i + 1``: storage ``i`` made with ``sizes[i]`` bytes; ``-(i + 1)``: freed) through a copy of
    ``start`` (left as it is), with ``capacity_bytes`` in place of its own where given; stop at the first request
    it cannot serve. With the trial's ``marks``, only its whole steps run, and then its last step up to
    ``settle_steps`` times more, until the allocator settles (see the module's docstring)."""
    allocator = start.copy()
    if capacity_bytes is not None:
        allocator.capacity_bytes = capacity_bytes
    allocator.reset_peak()
    spans = StepSpans.of(marks) if marks is not None else None
    blocks: list[Block | None] = [None] * len(sizes)
    stop = spans.ends[-1] if spans is not None else len(events)
    failed = _run(allocator, events[:stop].tolist(), sizes, blocks)
    if failed is not None:
        if spans is None:
            return _outcome(allocator, False)
        return _outcome(allocator, False, spans.step_of(failed), failed_phase=spans.phase_of(failed))
    if spans is None:
        return _outcome(allocator, True)
    steady = SteadyStep.of(events, spans.begins[-1], spans.ends[-1], sizes) if settle_steps > 0 else None
    if steady is None:
        return _outcome(allocator, True, len(spans.begins))
    return _settle(allocator, steady, sizes, blocks, spans, settle_steps)


def replay_loops(
    start: CachingAllocator,
    events: np.ndarray,
    sizes: np.ndarray,
    capacity_bytes: int | None = None,
    *,
    marks: Sequence[tuple[int, str]],
    settle_steps: int = SETTLE_STEPS,
    orders: Sequence[LoopOrder] = LOOP_ORDERS,
) -> Replay:
    """``replay`` of the trial as each loop in ``orders`` runs it (``batchfit.devices.loop_orders``): the one that
    runs out of memory first (its ``loop``; the first in ``orders`` among equals); else one served by all, with
    the most steps any ran and ``settled`` only where every loop settled. Once a loop has failed at step k, the
    others run to step k - 1 only: all that can still fail earlier."""
    trial_steps = sum(label == "step" for _, label in marks)
    failed: Replay | None = None
    outcomes = []
    for order in orders:
        budget = settle_steps if failed is None else max(failed.failed_step - 1 - trial_steps, 0)
        ordered, ordered_marks = reordered(events, marks, order)
        outcome = replay(start, ordered, sizes, capacity_bytes, marks=ordered_marks, settle_steps=budget)
        if not outcome.served and (failed is None or outcome.failed_step < failed.failed_step):
            failed = dataclasses.replace(outcome, loop=order)
        outcomes.append(outcome)
    if failed is not None:
        return failed
    settled = [outcome.settled for outcome in outcomes]
    return dataclasses.replace(
        max(outcomes, key=lambda outcome: outcome.peak_reserved_bytes),
        loop_steps=max(outcome.loop_steps for outcome in outcomes),
        settled=None if None in settled else all(settled),
    )


def _run(allocator: CachingAllocator, events: list[int], sizes: np.ndarray, blocks: list[Block | None]) -> int | None:
    """Serve ``events`` in order, keeping each storage's block in ``blocks``; the position of the first request
    not served, or ``None``."""
    malloc, free = allocator.malloc, allocator.free
    for position, event in enumerate(events):
        if event > 0:
            block = malloc(int(sizes[event - 1]))
            if block is None:
                return position
            blocks[event - 1] = block
        else:
            block = blocks[-event - 1]
            if block is not None:
                free(block)
                blocks[-event - 1] = None
    return None


def _settle(
    allocator: CachingAllocator,
    steady: SteadyStep,
    sizes: np.ndarray,
    blocks: list[Block | None],
    spans: StepSpans,
    settle_steps: int,
) -> Replay:
    """The steady step again and again after the trial's ``len(spans.begins)`` steps, each freeing the blocks the
    one before kept, until the allocator's state (with where the kept blocks sit) repeats."""
    steps = len(spans.begins)
    kept = [blocks[i] for i in steady.kept]
    seen = {_key(allocator, kept)}
    malloc, free = allocator.malloc, allocator.free
    partner = {before: steady.kept.index(now) for before, now in steady.freed_before.items()}
    for step in range(steps + 1, steps + settle_steps + 1):
        made: dict[int, Block] = {}
        for position, event in enumerate(steady.events):
            if event > 0:
                block = malloc(int(sizes[event - 1]))
                if block is None:
                    phase = spans.phase_of(spans.begins[-1] + position)
                    return _outcome(allocator, False, step, failed_phase=phase)
                made[event - 1] = block
            elif -event - 1 in made:
                free(made.pop(-event - 1))
            else:
                free(kept[partner[-event - 1]])
        kept = [made[i] for i in steady.kept]
        key = _key(allocator, kept)
        if key in seen:
            return _outcome(allocator, True, step, settled=True)
        seen.add(key)
    return _outcome(allocator, True, steps + settle_steps, settled=False)


def _key(allocator: CachingAllocator, kept: list[Block | None]) -> tuple:
    return allocator.state_key({id(block): number for number, block in enumerate(kept) if block is not None})


def _outcome(
    allocator: CachingAllocator,
    served: bool,
    step: int | None = None,
    *,
    settled: bool | None = None,
    failed_phase: str | None = None,
) -> Replay:
    stats = allocator.stats
    return Replay(
        served,
        stats.peak_reserved_bytes,
        stats.peak_allocated_bytes,
        loop_steps=step or 0,
        settled=settled,
        failed_step=None if served else step,
        failed_phase=failed_phase,
    )


def events_from_lifetimes(born: np.ndarray, freed: np.ndarray, length: int) -> np.ndarray:
    """An event order from each storage's first and last timeline index (where no order was logged): at each
    op, the storages freed before it first, then those it made, in the order they were made, then those it made
    and freed within itself. Those that outlive the timeline are never freed.

    >>> events_from_lifetimes(np.array([0, 1, 1]), np.array([2, 1, 3]), 3).tolist()
    [1, 2, 3, -2, -1]
    """
    index = np.arange(len(born))
    made = np.stack([born, np.ones_like(born), index, index + 1], axis=1)
    gone = freed < length
    freed_order = np.where(freed[gone] == born[gone], 2, 0)
    frees = np.stack([freed[gone], freed_order, index[gone], -(index[gone] + 1)], axis=1)
    table = np.concatenate([made, frees])
    order = np.lexsort((table[:, 2], table[:, 1], table[:, 0]))
    return table[order, 3]
