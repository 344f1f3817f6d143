"""Agreement across ranks with torch.distributed, so that every rank tries the same sizes and
shrinks together: no rank is ever left waiting in a collective the others will not join.

Every agreement of a search waits at most ``agreement_timeout()`` for the other ranks, whatever
stopped them (an error they caught, a hang, an exit), and then names them; a rank left waiting so ends its
process with status 1 rather than hang at its exit (``_exit_when_done``), and torchrun ends the job. A rank whose trial
raises says so in the agreement of that trial (``probe_together``), so the others stop at once
with its error in theirs."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import pickle
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from batchfit.search.trial import Trial

TIMEOUT_VARIABLE = "BATCHFIT_AGREEMENT_TIMEOUT_SECONDS"  # default 120

logger = logging.getLogger("batchfit")


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


def _others() -> str:
    """The ranks but this one, as an error names them: ``rank 0``, or ``one of ranks 0, 2, 3``."""
    import torch.distributed as dist

    others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
    return f"rank {others[0]}" if len(others) == 1 else "one of ranks " + ", ".join(map(str, others))


class RankStoppedError(RuntimeError):
    """Another rank stopped agreeing: its trial or step raised, or it hangs or left. Never a
    reason to fall back (to real probes after a trace, say): every rank must stop."""


def _wait(work: Any) -> None:
    """Wait for the collective ``work`` at most ``agreement_timeout()``; then a ``RuntimeError``
    naming the ranks that did not join it (the process group is unusable after that)."""
    import torch.distributed as dist

    timeout = agreement_timeout()
    try:
        work.wait(timeout)
    except RuntimeError as error:
        _exit_when_done()
        raise RankStoppedError(
            f"batchfit: a rank did not reach the batch-size agreement within {timeout.total_seconds():g} s "
            f"({TIMEOUT_VARIABLE}): {_others()} stopped agreeing (it raised, hangs or left: its own log "
            f"says which), so rank {dist.get_rank()} stops too; this process group cannot be used any more "
            f"({str(error).strip()})"
        ) from error


def _exit_when_done() -> None:
    """Once a peer never joined a collective, this process cannot end: its process group waits for that
    collective as the interpreter shuts down. It then ends with status 1 where it would hang (an ``atexit``
    hook, after everything else the program does and prints), so that torchrun sees a failed rank and ends the
    job rather than leaving it to its own timeout."""
    if not _EXITING:
        _EXITING.append(True)
        atexit.register(_exit_now)


_EXITING: list[bool] = []


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def _reduce(value: int, op_name: str, bounded: bool = True) -> int:
    """``value`` reduced over the ranks by ``op_name``; ``bounded``: waiting at most ``agreement_timeout()``."""
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    op = getattr(dist.ReduceOp, op_name)
    if bounded:
        _wait(dist.all_reduce(tensor, op=op, async_op=True))
    else:
        dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def agree_min(value: int) -> int:
    """The smallest ``value`` over all ranks."""
    return _reduce(value, "MIN")


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank (an OOM anywhere means everyone shrinks). Once per
    training step, where ranks may legitimately be far apart (one saves a checkpoint, say): it
    waits as long as the process group's own timeout, not ``agreement_timeout()``."""
    return bool(_reduce(int(flag), "MAX", bounded=False))


STEP_FITS, STEP_OOM, STEP_RAISED = 0, 1, 2  # a training step's outcome on one rank, worst last


def worst_step_outcome(outcome: int) -> int:
    """The worst of every rank's step outcome (``STEP_FITS``, ``STEP_OOM``, ``STEP_RAISED``): one
    all-reduce per step, the same collective ``any_rank`` makes, so a rank whose step raised is
    heard by the others instead of leaving them waiting."""
    return _reduce(outcome, "MAX", bounded=False)


def report_raised_step(error: BaseException) -> None:
    """Tell the other ranks, in this step's agreement, that this rank's step raised ``error`` (the
    caller re-raises it). Never raises itself: when they cannot be told, a warning says so."""
    try:
        worst_step_outcome(STEP_RAISED)
    except RuntimeError as failure:
        logger.warning("batchfit: could not tell the other ranks that this rank's step raised %s: %s", error, failure)


def _gather(payload: object) -> list[Any]:
    """Every rank's ``payload`` (picklable), in rank order; each of the two collectives waits at
    most ``agreement_timeout()``."""
    import torch.distributed as dist

    device, world = _device(), dist.get_world_size()
    data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8).to(device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    _wait(dist.all_gather(lengths, length, async_op=True))
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _wait(dist.all_gather(gathered, padded, async_op=True))
    return [pickle.loads(t[:size].cpu().numpy().tobytes()) for t, size in zip(gathered, sizes, strict=True)]


@dataclasses.dataclass(frozen=True)
class _Raised:
    """What a rank whose trial raised (not out of memory) says in that trial's agreement."""

    rank: int
    batch_size: int
    error: str  # "ValueError (its message's first line)"

    @classmethod
    def of(cls, batch_size: int, error: BaseException) -> _Raised:
        lines = str(error).strip().splitlines()
        named = f"{type(error).__name__} ({lines[0][:200]})" if lines else type(error).__name__
        return cls(rank(), batch_size, named)


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


def _raise_for(raised: list[_Raised]) -> None:
    first = raised[0]
    raise RankStoppedError(
        f"batchfit: rank {first.rank}'s trial of batch size {first.batch_size} raised {first.error}, "
        f"so rank {rank()} stops the batch-size search too"
    )


def agree_trial(trial: Trial) -> Trial:
    """Every rank's outcome of the same trial, merged identically on all ranks; a ``RuntimeError``
    naming the rank and its error when a rank's trial raised (see ``probe_together``)."""
    outcomes = _gather(trial)
    raised = [o for o in outcomes if isinstance(o, _Raised)]
    if raised:
        _raise_for(raised)
    return _merge(outcomes)


def report_failed_trial(batch_size: int, error: BaseException) -> None:
    """Tell the other ranks, in the agreement they wait in for this trial, that this rank's trial
    raised ``error``: they raise a ``RuntimeError`` naming this rank and the error, and the caller
    re-raises ``error``. Never raises itself: when the others cannot be told, a warning says so."""
    try:
        _gather(_Raised.of(batch_size, error))
    except RuntimeError as failure:
        logger.warning("batchfit: could not tell the other ranks that this rank's trial raised: %s", failure)


def probe_together(probe: Callable[[int], Trial], batch_size: int) -> Trial:
    """``probe(batch_size)`` on every rank, merged by ``agree_trial``; when it raises here, the other
    ranks learn it in this trial's agreement (and stop) before the error propagates."""
    try:
        trial = probe(batch_size)
    except Exception as error:
        report_failed_trial(batch_size, error)
        raise
    return agree_trial(trial)


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
