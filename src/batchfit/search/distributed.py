"""Agreement across ranks with torch.distributed, so that every rank tries the same sizes and
shrinks together: no rank is ever left waiting in a collective the others will not join."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch

from batchfit.search.trial import Trial

TIMEOUT_VARIABLE = "BATCHFIT_AGREEMENT_TIMEOUT_SECONDS"  # default 120


def agreement_timeout() -> timedelta:
    """How long a rank waits for the others to reach an agreement before naming who is missing."""
    return timedelta(seconds=float(os.environ.get(TIMEOUT_VARIABLE, "120")))


def active() -> bool:
    """True under an initialised process group with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _reduce(value: int, op_name: str, check: bool = True) -> int:
    import torch.distributed as dist

    if check:
        _fail_fast_if_a_rank_is_gone()
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op_name))
    return int(tensor.item())


def agree_min(value: int) -> int:
    """The smallest ``value`` over all ranks."""
    return _reduce(value, "MIN")


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank (an OOM anywhere means everyone shrinks)."""
    return bool(_reduce(int(flag), "MAX", check=False))  # once per training step: no extra barrier


def _merge(trials: list[Trial]) -> Trial:
    """One trial as the slowest, fullest rank saw it: fits only if it fit everywhere."""
    fitted = all(t.fits for t in trials)
    peaks = [t.peak_bytes for t in trials]
    phases = {phase: max(t.phase_peak_bytes.get(phase, 0) for t in trials) for phase in trials[0].phase_peak_bytes}
    timelines = [t.timeline for t in trials]
    same = all(timeline is not None and len(timeline) == len(timelines[0]) for timeline in timelines)
    merged_timeline = tuple(max(values) for values in zip(*timelines, strict=True)) if same else None
    failed = next((t for t in trials if not t.fits), None)
    return dataclasses.replace(
        trials[0],
        fits=fitted,
        peak_bytes=None if None in peaks else max(peaks),
        seconds=max(t.seconds for t in trials),
        error=None if failed is None else failed.error,
        oom=any(t.oom for t in trials),
        failed_phase=None if failed is None else failed.failed_phase,
        phase_peak_bytes=phases,
        held_bytes=max((t.held_bytes or 0) for t in trials),
        timeline=merged_timeline,
        exact_timeline=None,  # per-rank rounding differs; the merged timeline is rounded
    )


def agree_trial(trial: Trial) -> Trial:
    """Every rank's outcome of the same trial, merged identically on all ranks."""
    import torch.distributed as dist

    _fail_fast_if_a_rank_is_gone()
    gathered: list[Trial | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trial)
    return _merge([t for t in gathered if t is not None])


def _fail_fast_if_a_rank_is_gone() -> None:
    """With gloo, a rank that died is named within ``agreement_timeout()`` instead of a hang
    (NCCL has no monitored barrier: there the process group's own timeout applies)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=agreement_timeout())
        except RuntimeError as error:
            raise RuntimeError(f"batchfit: a rank did not reach the batch-size agreement: {error}") from error


def average_gradients(model: torch.nn.Module) -> None:
    """What DDP's backward would have done: average every gradient over the ranks. Every
    trainable parameter takes part, with zeros where this rank left it unused, so all ranks make
    the same collectives in the same order."""
    import torch.distributed as dist

    world = dist.get_world_size()
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
        param.grad.div_(world)
