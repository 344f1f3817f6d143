"""FitResult: what an integration set, in one vocabulary for Lightning and Hugging Face.

Both integrations search the framework's own step, split a requested global batch with
``plan_batch`` and return a ``FitResult`` (Lightning's ``BatchFitResult`` and the Transformers
``TrainerFit`` are it, plus the framework's old names for one release). ``search_and_plan`` is the
one path both take from a workload to a plan, so a global batch is treated the same in both: one
that cannot be split exactly into micro-batch x accumulation x devices is a ``ValueError`` unless
``allow_inexact=True``, and then the closest split ``plan_batch`` finds, with a ``UserWarning``
naming it. The global batch never changes silently. Nothing here imports a framework.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.errors import InputError
from batchfit.planning.plan import BatchPlan
from batchfit.planning.plan import plan_batch
from batchfit.search.result import SearchResult
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.workflows.workload_plan import plan_workload

__all__ = ["LOOP_HEADROOM", "FitResult", "deprecated_alias", "plan_global_batch", "search_and_plan"]

# A framework's training loop holds a few small tensors the step batchfit probes does not (logged
# values, the closure's loss: Lightning's about 2 KiB, the Transformers Trainer's about 3 KiB, at any
# batch size, measured on the simulated device); on CUDA they land in a 2 MiB small-block segment
# of the caching allocator, so both integrations keep that much headroom by default.
LOOP_HEADROOM = "2MiB"


@dataclass(frozen=True)
class FitResult:
    """What an integration found and set, under the same names for every framework.

    >>> from batchfit.search.result import SearchResult
    >>> found = SearchResult(batch_size=12, trials=[], strategy="binary", capacity_bytes=None,
    ...     limit_bytes=None, device="sim", min_batch_size=1, max_batch_size=12, upper_bound=12,
    ...     exact=True, seconds=0.5)
    >>> plan = plan_global_batch(12, 48, 2)
    >>> fit = FitResult(plan.micro_batch_size, plan.gradient_accumulation_steps, 2, found, found, plan=plan)
    >>> fit.global_batch_size, fit.exact_global_batch, fit.eval_batch_size
    (48, True, None)
    >>> fit.summary()
    'micro-batch 12 per device x 2 accumulation steps x 2 devices = global batch 48, as asked; largest that fits in one step: 12 (0 trials)'
    """

    micro_batch_size: int
    """Samples per device in one forward and backward pass (Lightning's ``batch_size``, the
    Trainer's ``per_device_train_batch_size``)."""
    gradient_accumulation_steps: int
    """Micro-batches summed per optimizer step (Lightning's ``accumulate_grad_batches``)."""
    world_size: int
    """Data-parallel devices whose micro-batches one optimizer step sums."""
    search: SearchResult
    """The search the micro-batch came from: of an accumulation micro-step (the window's gradients
    alive during the forward pass) when the plan accumulates, else ``one_step_search``."""
    one_step_search: SearchResult
    """The search of one plain training step (the same object as ``search`` without accumulation)."""
    eval_search: SearchResult | None = None
    """The eval-mode search that set the eval batch, or ``None`` when none ran."""
    plan: BatchPlan | None = None
    """How the requested global batch was split, or ``None`` when none was requested."""
    applied: Mapping[str, int] = field(default_factory=dict)
    """The framework's settings the fit set, under the framework's own names."""
    previous: Mapping[str, int] = field(default_factory=dict)
    """Those settings as they were before the fit."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "applied", dict(self.applied))  # a copy: the caller's dict stays theirs
        object.__setattr__(self, "previous", dict(self.previous))

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all devices: micro-batch x accumulation x world size."""
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    @property
    def requested_global_batch_size(self) -> int | None:
        """The global batch that was asked for (``None``: none was)."""
        return None if self.plan is None else self.plan.target_samples

    @property
    def exact_global_batch(self) -> bool:
        """Whether the global batch is the one asked for (true when none was asked for)."""
        return self.plan is None or self.plan.exact

    @property
    def eval_batch_size(self) -> int | None:
        """The eval batch per device the eval search found, or ``None`` when none ran."""
        return None if self.eval_search is None else self.eval_search.batch_size

    @property
    def accumulating(self) -> bool:
        """Whether ``search`` measured an accumulation micro-step rather than one plain step."""
        return self.search is not self.one_step_search

    def settings(self) -> dict[str, int]:
        """The framework's settings the fit set, under the framework's names (a copy of ``applied``)."""
        return dict(self.applied)

    def summary(self) -> str:
        """One sentence: the split, whether it is the global batch asked for, and what fits."""
        devices = "device" if self.world_size == 1 else "devices"
        steps = "step" if self.gradient_accumulation_steps == 1 else "steps"
        text = (
            f"micro-batch {self.micro_batch_size} per device x {self.gradient_accumulation_steps} accumulation "
            f"{steps} x {self.world_size} {devices} = global batch {self.global_batch_size}"
        )
        if self.plan is not None:
            asked = self.requested_global_batch_size
            text += ", as asked" if self.exact_global_batch else f", not the {asked} asked for (the closest split)"
        trials = len(self.one_step_search.trials) + (len(self.search.trials) if self.accumulating else 0)
        text += f"; largest that fits in one step: {self.one_step_search.batch_size}"
        if self.accumulating:
            text += f", with the window's gradients held: {self.search.batch_size}"
        text += f" ({trials} trials)"
        return text if self.eval_search is None else f"{text}; eval batch {self.eval_batch_size}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the split, the global batch asked for and got, the settings, the plan and the searches."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "requested_global_batch_size": self.requested_global_batch_size,
            "exact_global_batch": self.exact_global_batch,
            "eval_batch_size": self.eval_batch_size,
            "settings": self.settings(),
            "previous": dict(self.previous),
            "plan": None if self.plan is None else self.plan.to_dict(),
            "search": search_summary(self.search),
            "one_step_search": search_summary(self.one_step_search),
            "eval_search": search_summary(self.eval_search),
        }


def search_summary(result: SearchResult | None) -> dict[str, Any] | None:
    """A search's answer in a few JSON-ready numbers (``None`` for no search)."""
    if result is None:
        return None
    return {
        "batch_size": result.batch_size,
        "trials": len(result.trials),
        "device": result.device,
        "peak_bytes": result.peak_bytes,
        "capacity_bytes": result.capacity_bytes,
        "seconds": result.seconds,
    }


def deprecated_alias(old: str, new: str) -> property:
    """A read-only property ``old`` that returns ``new`` with a ``DeprecationWarning`` (kept one release)."""

    def read(self: Any) -> Any:
        warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(read, doc=f"Deprecated: ``{new}``.")


def plan_global_batch(
    max_micro_batch_size: int,
    global_batch_size: int,
    world_size: int,
    *,
    allow_inexact: bool = False,
    stacklevel: int = 2,
) -> BatchPlan:
    """``plan_batch``'s split of ``global_batch_size`` into micro-batches of at most ``max_micro_batch_size``.

    A split that is not exact is a ``ValueError`` unless ``allow_inexact``; then ``plan_batch``'s
    closest split is returned with a ``UserWarning`` naming it (placed by ``stacklevel``, as
    ``warnings.warn``'s).

    >>> plan = plan_global_batch(4, 61, 1)
    Traceback (most recent call last):
    ...
    batchfit.errors.InputError: a global batch of 61 cannot be split exactly into micro-batches of at most 4 on 1 device(s): the closest is 60 (4 x 15 x 1); choose a global batch with a divisor near 4 per device, or pass allow_inexact=True
    >>> plan_global_batch(4, 64, 1, allow_inexact=False).gradient_accumulation_steps
    16
    """
    plan = plan_batch(micro_batch_size=max_micro_batch_size, global_batch_size=global_batch_size, devices=world_size)
    if plan.exact:
        return plan
    message = (
        f"a global batch of {global_batch_size} cannot be split exactly into micro-batches of at most "
        f"{max_micro_batch_size} on {world_size} device(s): the closest is {plan.global_batch_size} "
        f"({plan.micro_batch_size} x {plan.gradient_accumulation_steps} x {world_size})"
    )
    if not allow_inexact:
        raise InputError(
            f"{message}; choose a global batch with a divisor near {max_micro_batch_size} per device, "
            "or pass allow_inexact=True"
        )
    warnings.warn(message, UserWarning, stacklevel=stacklevel)
    return plan


def search_and_plan(
    workload: Any,
    settings: SearchSettings,
    *,
    device: DeviceSpec = None,
    global_batch_size: int | None = None,
    world_size: int = 1,
    allow_inexact: bool = False,
    stacklevel: int = 2,
) -> tuple[SearchResult, SearchResult, BatchPlan | None]:
    """``(search, one_step_search, plan)``: search one plain step; when the plan for
    ``global_batch_size`` accumulates, search again as an accumulation micro-step (no larger), whose
    answer the plan then uses (``batchfit.workflows.workload_plan.plan_workload``, the command line's path too). Without a global batch the plan is ``None``. An inexact split is
    treated as ``plan_global_batch`` says, before the caller sets anything; ``stacklevel`` places
    its warning as ``warnings.warn``'s does, counted from this function."""
    if global_batch_size is None:
        one_step = search_workload(workload, settings, device=device)
        return one_step, one_step, None
    found = plan_workload(  # the held search, when the plan accumulates, is never above the one-step answer
        workload,
        lambda largest: plan_batch(micro_batch_size=largest, global_batch_size=global_batch_size, devices=world_size),
        settings,
        device=device,
    )
    plan = plan_global_batch(
        found.search.batch_size, global_batch_size, world_size, allow_inexact=allow_inexact, stacklevel=stacklevel + 1
    )
    return found.search, found.one_step, plan
