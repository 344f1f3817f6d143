"""A soak: a whole run of a training loop replayed through the caching allocator model, step by step, each step
at its own shape, with evaluation passes between, from the allocator requests one trial per shape logged.

A run is not its first step. The caching allocator carries its cache from one step to the next, so a step of a
short batch after a long one finds the long one's blocks cached, split where they were split; an evaluation pass
lands its batches while the last training step's batch, output and loss still live. Whether the thousandth step
is served depends on the 999 before it, in their order. So each shape is run once on the counting device (its
logged requests and frees, ``StepLog``) and the run is the logs stitched together: every step frees what the step
before left alive (its batch, output and loss, matched in the order they were made) and leaves its own.

Nothing is computed per step: a step is its logged requests, served by the model under torch's rules
(``batchfit.devices.caching_allocator``). Where every step has one shape, the state is compared at each period
(a step, or the steps between evaluation passes): once it repeats, every later period is served as one already
was, and the rest of the run is the periods seen, repeated.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

import numpy as np

from batchfit.devices.allocator_blocks import Block
from batchfit.devices.allocator_replay import SteadyStep
from batchfit.devices.allocator_replay import StepSpans
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.errors import InputError


@dataclass(frozen=True)
class StepLog:
    """One shape's trial of two steps, cut into what a run replays: the first step (and anything before it),
    which makes the optimizer's state; the steady step; and which storages each leaves for the next step to
    free, in the order they were made. ``sizes[i]`` is storage ``i``'s bytes; an event ``i + 1`` makes it,
    ``-(i + 1)`` frees it. ``start`` is the allocator's state when the trial began (the model's state held)."""

    sizes: list[int]
    first: list[int]
    left_by_first: list[int]
    steady: list[int]
    rank_of_freed: dict[int, int]  # a storage the steady step frees but did not make -> its place in what was left
    left_by_steady: list[int]
    start: CachingAllocator | None = None

    @classmethod
    def of(
        cls,
        events: np.ndarray,
        sizes: np.ndarray,
        marks: Sequence[tuple[int, str]],
        start: CachingAllocator | None = None,
    ) -> StepLog:
        """From a trial's ``LiveBytes.event_log``, ``storage_log`` sizes and ``step_marks`` (two steps or more: the
        last is the steady one). An ``InputError`` where the trial has no steady step to repeat.

        >>> events = np.array([1, 2, 3, -3, 4, -1, 5, -5])   # storages 0 and 3 batches, 1 optimizer state, 2 and 4 grads
        >>> log = StepLog.of(events, np.array([8, 4, 16, 8, 16]), [(0, "step"), (4, "step"), (8, "end")])
        >>> log.first, log.left_by_first, log.steady, log.left_by_steady
        ([1, 2, 3, -3], [0], [4, -1, 5, -5], [3])
        """
        spans = StepSpans.of(marks)
        if spans is None or len(spans.begins) < 2:
            raise InputError("a soak needs a trial of two whole steps or more: give steps=2 or more")
        steady = SteadyStep.of(events, spans.begins[-1], spans.ends[-1], sizes)
        if steady is None:
            raise InputError(
                "this loop keeps something of every step (its last step leaves more alive than it frees): a run of "
                "it grows without end, so no soak can hold; free what each step keeps"
            )
        freed_before = sorted(steady.freed_before)
        return cls(
            sizes=[int(size) for size in sizes],
            first=events[: spans.ends[0]].tolist(),
            left_by_first=freed_before,
            steady=steady.events,
            rank_of_freed={storage: rank for rank, storage in enumerate(freed_before)},
            left_by_steady=list(steady.kept),
            start=start,
        )


@dataclass(frozen=True)
class SoakPlan:
    """The steps of a run: ``train[k]`` names the shape of step ``k + 1`` (a key of the training logs); after every
    ``eval_every_steps`` steps an evaluation pass runs one step of each shape in ``eval_shapes`` (keys of the
    evaluation logs), while the last training step's batch, output and loss still live.

    >>> SoakPlan(("short", "long", "short"), eval_every_steps=2, eval_shapes=("long",)).eval_after(2)
    True
    """

    train: tuple[Hashable, ...]
    eval_every_steps: int | None = None
    eval_shapes: tuple[Hashable, ...] = ()

    def eval_after(self, step: int) -> bool:
        return bool(self.eval_every_steps) and bool(self.eval_shapes) and step % self.eval_every_steps == 0

    def fixed(self) -> bool:
        """Every training step of one shape and every evaluation pass alike: the run is periodic."""
        return len(set(self.train)) == 1


@dataclass(frozen=True)
class Soak:
    """What a run did in the allocator model: ``served`` every request of every step, or ran out of memory at
    ``failed_step`` (1 is the first), in its evaluation pass where ``failed_in_eval``, on a step of shape
    ``failed_shape``. Per training step run: ``reserved_bytes`` (the most reserved during it, its evaluation pass
    included) and ``retries`` (the times the allocator freed its cache and tried again, ``num_alloc_retries``).
    ``repeated_from_step``: the step after which the state repeated (a fixed shape), the rest of the run read
    from the periods before it."""

    served: bool
    steps: int
    reserved_bytes: tuple[int, ...]
    retries: tuple[int, ...]
    failed_step: int | None = None
    failed_in_eval: bool = False
    failed_shape: Hashable | None = None
    repeated_from_step: int | None = None
    replayed_steps: int = 0

    @property
    def steps_run(self) -> int:
        return len(self.reserved_bytes)

    @property
    def peak_reserved_bytes(self) -> int:
        return max(self.reserved_bytes, default=0)

    @property
    def steps_with_retries(self) -> int:
        return sum(1 for count in self.retries if count)

    def to_dict(self) -> dict:
        return {
            "served": self.served,
            "steps": self.steps,
            "steps_run": self.steps_run,
            "failed_step": self.failed_step,
            "failed_in_eval": self.failed_in_eval,
            "failed_shape": _jsonable(self.failed_shape),
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "steps_with_retries": self.steps_with_retries,
            "most_retries_in_a_step": max(self.retries, default=0),
            "repeated_from_step": self.repeated_from_step,
            "reserved_bytes": list(self.reserved_bytes),
            "retries": list(self.retries),
        }


def _jsonable(shape: Hashable | None) -> object:
    return list(shape) if isinstance(shape, tuple) else shape


class _Failed(Exception):
    """A request the allocator could not serve, on a step of ``shape``."""

    def __init__(self, shape: Hashable):
        self.shape = shape


@dataclass
class _Run:
    """The allocator and what the last training step left alive, carried from step to step."""

    allocator: CachingAllocator
    left: list[Block] = field(default_factory=list)

    def first(self, log: StepLog, shape: Hashable) -> list[Block]:
        blocks: dict[int, Block] = {}
        malloc, free = self.allocator.malloc, self.allocator.free
        for event in log.first:
            if event > 0:
                block = malloc(log.sizes[event - 1])
                if block is None:
                    raise _Failed(shape)
                blocks[event - 1] = block
            elif -event - 1 in blocks:
                free(blocks.pop(-event - 1))
        return [blocks[storage] for storage in log.left_by_first]

    def steady(self, log: StepLog, shape: Hashable, left: list[Block]) -> list[Block]:
        made: dict[int, Block] = {}
        malloc, free, sizes, rank = self.allocator.malloc, self.allocator.free, log.sizes, log.rank_of_freed
        for event in log.steady:
            if event > 0:
                block = malloc(sizes[event - 1])
                if block is None:
                    raise _Failed(shape)
                made[event - 1] = block
            elif -event - 1 in made:
                free(made.pop(-event - 1))
            else:
                free(left[rank[-event - 1]])
        return [made[storage] for storage in log.left_by_steady]

    def step(self, log: StepLog, shape: Hashable, number: int) -> None:
        self.left = self.first(log, shape) if number == 1 else self.steady(log, shape, self.left)

    def evaluate(self, logs: Mapping[Hashable, StepLog], shapes: Sequence[Hashable]) -> None:
        """An evaluation pass, a function of its own: its batches and outputs freed when it returns."""
        left: list[Block] = []
        for number, shape in enumerate(shapes, 1):
            left = self.first(logs[shape], shape) if number == 1 else self.steady(logs[shape], shape, left)
        for block in left:
            self.allocator.free(block)

    def key(self) -> tuple:
        return self.allocator.state_key({id(block): number for number, block in enumerate(self.left)})


def check_logs_agree(logs: Mapping[Hashable, StepLog], what: str) -> None:
    """Every shape's step must leave as many storages for the next as every other's frees: the same loop."""
    counts = {shape: len(log.left_by_steady) for shape, log in logs.items()}
    if len(set(counts.values())) > 1:
        raise InputError(
            f"the {what} steps of different shapes leave different numbers of tensors alive into the next step "
            f"({counts}): a soak stitches steps of one loop; give a step whose outputs do not depend on the shape"
        )


def soak(
    train_logs: Mapping[Hashable, StepLog],
    plan: SoakPlan,
    capacity_bytes: int,
    *,
    start: CachingAllocator,
    eval_logs: Mapping[Hashable, StepLog] | None = None,
) -> Soak:
    """Run ``plan`` through a copy of ``start`` (the allocator as the loop begins, the model's state held; left as
    it is) at ``capacity_bytes``, every step from its shape's log; stop at the first request it cannot serve.

    >>> from batchfit.devices.allocator_settings import MIB
    >>> log = StepLog.of(np.array([1, 2, -2, 3, 4, -1, -4]), np.array([MIB // 4, MIB, MIB // 4, MIB]),
    ...                  [(0, "step"), (3, "step"), (7, "end")])
    >>> run = soak({"b": log}, SoakPlan(("b",) * 1000), 64 * MIB, start=CachingAllocator(64 * MIB))
    >>> run.served, run.steps_run, run.peak_reserved_bytes // MIB, run.repeated_from_step
    (True, 1000, 2, 3)
    """
    eval_logs = eval_logs or {}
    check_logs_agree(train_logs, "training")
    allocator = start.copy()
    allocator.capacity_bytes = capacity_bytes
    run = _Run(allocator)
    reserved: list[int] = []
    retries: list[int] = []
    seen: dict[tuple, int] = {}
    fixed = plan.fixed()
    for number, shape in enumerate(plan.train, 1):
        allocator.reset_peak()
        before = allocator.stats.num_alloc_retries
        in_eval = False
        try:
            run.step(train_logs[shape], shape, number)
            if plan.eval_after(number):
                in_eval = True
                run.evaluate(eval_logs, plan.eval_shapes)
        except _Failed as failed:
            return Soak(False, len(plan.train), tuple(reserved), tuple(retries), number, in_eval, failed.shape)
        reserved.append(allocator.stats.peak_reserved_bytes)
        retries.append(allocator.stats.num_alloc_retries - before)
        period = plan.eval_every_steps if plan.eval_every_steps and plan.eval_shapes else 1
        if fixed and number % period == 0:
            key = run.key()
            if key in seen:
                return _repeated(plan, reserved, retries, seen[key], number)
            seen[key] = number
    return Soak(True, len(plan.train), tuple(reserved), tuple(retries), replayed_steps=len(plan.train))


def _repeated(plan: SoakPlan, reserved: list[int], retries: list[int], earlier: int, now: int) -> Soak:
    """The run whose state after step ``now`` is its state after step ``earlier``: steps ``earlier + 1`` to ``now``
    again and again to the end."""
    period = now - earlier
    for number in range(now + 1, len(plan.train) + 1):
        reserved.append(reserved[number - 1 - period])
        retries.append(retries[number - 1 - period])
    return Soak(True, len(plan.train), tuple(reserved), tuple(retries), repeated_from_step=now, replayed_steps=now)
