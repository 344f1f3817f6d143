"""The orders in which training loops free two things, drawn from one trial's event log.

A trial frees the last step's batch only once the new one is copied in (``batch = next_batch.to(device)``
rebinds a name that still holds it), and the gradients at the end of each step (``optimizer.zero_grad()`` after
``optimizer.step()``). Loops people write also free them elsewhere, and under a caching allocator where a block is
freed decides where the next one lands:

- ``for x, y in loader: x, y = x.to(device), y.to(device)`` (PyTorch's tutorial) and ``for batch in loader:
  batch = {k: v.to(device) ...}`` (the Hugging Face course) free the last batch when ``for`` rebinds the names to
  the host's rows, before the copy;
- ``optimizer.zero_grad()`` at the top of the step, after the copy, keeps the last step's gradients alive while
  the new batch lands.

Each order is the trial's own log with those frees moved (``reordered``), so one trial answers for all four loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Marks = list[tuple[int, str]]


@dataclass(frozen=True)
class LoopOrder:
    """Where a loop frees the last step's batch and its gradients.

    >>> [order.describe() for order in LOOP_ORDERS][3]
    'the last batch freed before the copy, zero_grad after it'
    """

    batch_freed_first: bool = False  # the last batch freed before the new one is copied in
    zero_grad_first: bool = False  # zero_grad after the copy, at the top of the step (not at the end)

    def describe(self) -> str:
        batch = "the last batch freed before the copy" if self.batch_freed_first else "the new batch copied in first"
        return f"{batch}, zero_grad {'after it' if self.zero_grad_first else 'at the end of the step'}"


TRIAL_ORDER = LoopOrder()
LOOP_ORDERS = tuple(LoopOrder(first, zero) for first in (False, True) for zero in (False, True))


@dataclass(frozen=True)
class _Step:
    """One step of a trial's log: the batch's copy (``begin:copied``), the step's body (``copied:zeroed``) and the
    frees of ``zero_grad`` (``zeroed:end``)."""

    begin: int
    copied: int
    zeroed: int
    end: int


def _steps(marks: Sequence[tuple[int, str]]) -> list[_Step] | None:
    """Each whole step of a trial's ``marks`` (``None`` where there are none: a trial cut short)."""
    begins = [at for at, label in marks if label == "step"]
    ends = [at for at, label in marks if label == "end"]
    if not begins or not ends:
        return None
    steps = []
    for begin, end in zip(begins, [*begins[1:], ends[-1]], strict=True):
        inside = {label: at for at, label in marks if begin <= at <= end and label in ("batch", "zero_grad")}
        steps.append(_Step(begin, inside.get("batch", begin), inside.get("zero_grad", end), end))
    return steps


def reordered(events: np.ndarray, marks: Sequence[tuple[int, str]], order: LoopOrder) -> tuple[np.ndarray, Marks]:
    """The trial's ``events`` and ``marks`` as a loop in ``order`` would make them: its whole steps only (the
    gradients of the last one left alive where ``zero_grad`` comes first), every mark moved with its events.

    >>> events = np.array([1, -2, 3, 4, -4, -3, 5, -1, 6, 7, -7, -6])   # 2: the batch before; 3 and 6 gradients
    >>> marks = [(0, "step"), (2, "batch"), (5, "zero_grad"), (6, "step"), (8, "batch"), (11, "zero_grad"), (12, "end")]
    >>> reordered(events, marks, LoopOrder(batch_freed_first=True, zero_grad_first=True))[0].tolist()
    [-2, 1, 3, 4, -4, -1, 5, -3, 6, 7, -7]
    """
    steps = _steps(marks)
    if steps is None or order == TRIAL_ORDER:
        return events, list(marks)
    out: list[int] = events[: steps[0].begin].tolist()
    moved: Marks = [(at, label) for at, label in marks if at < steps[0].begin]
    pending: list[int] = []  # the last step's gradients, freed by this step's zero_grad
    for step in steps:
        copy = events[step.begin : step.copied].tolist()
        if order.batch_freed_first:
            copy = [e for e in copy if e < 0] + [e for e in copy if e > 0]
        moved.append((len(out), "step"))
        out += copy
        moved.append((len(out), "batch"))
        if order.zero_grad_first:
            out += pending
        shift = len(out) - step.copied
        body_end = len(out) + step.zeroed - step.copied
        for at, label in marks:
            if step.copied < at <= step.end and label not in ("step", "batch", "end"):
                moved.append((min(at + shift, body_end) if order.zero_grad_first else at + shift, label))
        out += events[step.copied : step.zeroed].tolist()
        grads = events[step.zeroed : step.end].tolist()
        if order.zero_grad_first:
            pending = grads
        else:
            out += grads
    moved.append((len(out), "end"))
    return np.array(out, dtype=np.int64), sorted(moved, key=lambda mark: mark[0])
