"""A plan for a workload: measure the largest micro-batch, plan, and measure again as a later micro-batch of
the accumulation window when the plan accumulates.

A later micro-batch runs with the window's gradients alive through its forward and backward, so it fits
less than one plain step; when the plan needs more than one micro-batch per optimizer step, the micro-batch
is searched again that way (never above the first answer) and the plan is made from that answer. The
command line (``batchfit plan WORKLOAD``) and both integrations (Lightning, the Transformers Trainer) take
this one path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchfit.devices.trace import TraceDevice
from batchfit.planning.plan import BatchPlan
from batchfit.search.result import SearchResult
from batchfit.search.runner import DeviceSpec
from batchfit.search.runner import search_workload
from batchfit.search.settings import SearchSettings
from batchfit.step.workload import Workload
from batchfit.workflows.arguments import check_callable
from batchfit.workflows.arguments import check_flag
from batchfit.workflows.arguments import check_progress
from batchfit.workflows.arguments import check_settings
from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.rank_workloads import accumulating

Planner = Callable[[int], BatchPlan]  # the largest micro-batch -> the plan (plan_batch with the targets bound)


@dataclass(frozen=True)
class WorkloadPlan:
    """The plan and the searches it came from: ``one_step`` (one plain training step) and ``held`` (a later
    micro-batch of the window, its gradients held; ``None`` when the plan does not accumulate or the workload
    cannot run so, as MLX's)."""

    plan: BatchPlan
    one_step: SearchResult
    held: SearchResult | None = None

    @property
    def search(self) -> SearchResult:
        """The search whose answer the plan uses: ``held`` when there is one, else ``one_step``."""
        return self.held if self.held is not None else self.one_step


def holds_gradients(work: Any) -> bool:
    """Whether ``work`` can run as a later micro-batch of a window: a torch ``Workload``, or one rank of one."""
    return isinstance(work, Workload) or hasattr(work, "parallelism")


def measure_micro_batch(
    work: Any,
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    held: bool = False,
    progress: Progress = SILENT,
) -> SearchResult:
    """The search for the largest micro-batch of ``work``: one plain step, or with ``held`` a later
    micro-batch of an accumulation window (its gradients held); said as it is found."""
    check_settings(settings)
    check_flag("held", held)
    check_progress(progress)
    window = " with the accumulation window's gradients held" if held else ""
    if held:
        work = accumulating(work)
    with progress.working(f"Measuring the largest micro-batch{window}"):
        measured = search_workload(work, settings, device=device)
    traced = isinstance(device, TraceDevice)
    per_rank = f" ({work.mode(traced)})" if hasattr(work, "parallelism") else ""  # one rank
    progress.said(f"Measured on {measured.device}{per_rank}{window}: the largest micro-batch is {measured.batch_size}.")
    return measured


def plan_workload(
    work: Any,
    planner: Planner,
    settings: SearchSettings | None = None,
    *,
    device: DeviceSpec = None,
    progress: Progress = SILENT,
) -> WorkloadPlan:
    """Measure ``work``'s largest micro-batch on ``device``, plan with ``planner``, and when the plan
    accumulates measure again with the window's gradients held (at most the first answer) and plan again.

    >>> import torch, batchfit as bf
    >>> from batchfit.planning.plan import plan_batch
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Linear(64, 64)
    >>> work = bf.Workload(model, torch.randn(2, 64), loss_fn=lambda out, batch: out.square().mean(),
    ...                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    >>> found = plan_workload(work, lambda largest: plan_batch(micro_batch_size=largest, global_batch_size=4096),
    ...                       device="sim:1MiB")
    >>> found.held is not None, found.plan.micro_batch_size <= found.held.batch_size <= found.one_step.batch_size
    (True, True)
    """
    check_callable(
        "planner", planner, "the largest micro-batch -> a BatchPlan, e.g. lambda b: plan_batch(micro_batch_size=b)"
    )
    check_settings(settings)
    settings = settings or SearchSettings()
    one_step = measure_micro_batch(work, settings, device=device, progress=progress)
    plan = planner(one_step.batch_size)
    if plan.gradient_accumulation_steps == 1 or not holds_gradients(work):
        return WorkloadPlan(plan, one_step)
    capped = settings.replace(max_batch_size=one_step.batch_size)
    held = measure_micro_batch(work, capped, device=device, held=True, progress=progress)
    return WorkloadPlan(planner(held.batch_size), one_step, held)
