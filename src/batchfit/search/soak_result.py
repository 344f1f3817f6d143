"""What a soak found (``batchfit.search.soak``): the largest budget that held for the whole run, beside the
fresh-cache answer and the same with expandable segments, the runs themselves, and the advice in words."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.devices.allocator_soak import Soak

EXPANDABLE_UNAVAILABLE = (
    "expandable segments are not available beside vLLM's allocator (a colocated rollout engine) or where weights "
    "are shared over CUDA IPC"
)


@dataclass
class SoakedBudget:
    """The largest budget (``budget``: a batch size, or tokens per micro-batch) whose run held for every step,
    beside ``fresh`` (the answer from an emptied cache) and the same with expandable segments
    (``expandable_budget``; searched up to ``fresh``). ``held`` is the run at the answer, ``failed`` the run one
    budget above it (its first step out of memory, the shape it fell on), each with expandable segments too.
    ``None`` as a budget: not even the smallest held."""

    unit: str
    fresh: int
    budget: int | None
    held: Soak | None
    failed: Soak | None
    failed_budget: int | None
    expandable_budget: int | None
    expandable_held: Soak | None
    logged_shapes: int = 0
    log_seconds: float = 0.0
    soak_seconds: float = 0.0
    tried: dict[int, bool] = field(default_factory=dict)
    fresh_run: Soak | None = None  # the run at the fresh-cache answer (where it fails: the step it fails at)

    @property
    def binds(self) -> bool:
        """The run binds below the fresh-cache answer."""
        return self.budget != self.fresh

    def advice(self) -> str:
        """What to use, and what expandable segments would give."""
        if self.budget is None:
            first = "not even the smallest budget holds for the whole run"
        elif self.binds:
            first = f"use {self.budget} {self.unit}: {self.fresh} fits from an emptied cache but not for the whole run"
        else:
            first = f"{self.budget} {self.unit} holds for the whole run, as from an emptied cache"
        if self.expandable_budget is None:
            second = "not even the smallest holds with expandable segments"
        elif self.expandable_budget == self.fresh:
            second = f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, {self.fresh} holds (not searched above)"
        else:
            second = f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, {self.expandable_budget}"
        return f"{first}; {second}; {EXPANDABLE_UNAVAILABLE}."

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "fresh": self.fresh,
            "soaked": self.budget,
            "expandable_segments": self.expandable_budget,
            "failed_budget": self.failed_budget,
            "held": self.held.to_dict() if self.held is not None else None,
            "failed": self.failed.to_dict() if self.failed is not None else None,
            "expandable_held": self.expandable_held.to_dict() if self.expandable_held is not None else None,
            "fresh_run": self.fresh_run.to_dict() if self.fresh_run is not None else None,
            "logged_shapes": self.logged_shapes,
            "log_seconds": round(self.log_seconds, 3),
            "soak_seconds": round(self.soak_seconds, 3),
            "tried": {str(budget): held for budget, held in sorted(self.tried.items())},
            "advice": self.advice(),
        }


def soak_summary(document: dict[str, Any], steps: int) -> str:
    """A soak (``SoakedBudget.to_dict()``) in two sentences: the runs at the answer and above it, then the advice.

    >>> run = Soak(True, 100, (2**21,) * 100, (0,) * 100)
    >>> soak_summary(SoakedBudget("samples per batch", 8, 8, run, None, None, 8, run).to_dict(), 100)[:77]
    'Soak of 100 steps: 8 samples per batch held every step (peak reserved 2.0 MiB'
    """
    from batchfit.devices.units import format_bytes

    held, failed = document["held"], document["failed"]
    if held is None:
        first = f"Soak of {steps} steps: no budget held"
    else:
        first = (
            f"Soak of {steps} steps: {document['soaked']} {document['unit']} held every step (peak reserved "
            f"{format_bytes(held['peak_reserved_bytes'])}, {held['steps_with_retries']} steps with allocator retries, "
            f"at most {held['most_retries_in_a_step']} in one)"
        )
    if failed is not None and failed["failed_step"] is not None:
        where = " in the evaluation pass after it" if failed["failed_in_eval"] else ""
        first += f"; {document['failed_budget']} ran out of memory at step {failed['failed_step']}{where}"
    return f"{first}. Advice: {document['advice']}"
