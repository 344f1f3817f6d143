"""Which evidence the default search spends first: real trials, or the trace on fake tensors.

Both find the edge; what differs is their cost. A trace costs about the same at any batch size
(shapes only: a few fake trials of the step's ops), and on a real GPU a trial costs seconds and
every out-of-memory error fragments the allocator, so there the trace goes first. On a CPU or a
simulated device a trial at the smallest size often costs less than the trace would: the search
measures that trial first, then traces only if the trace is predicted to cost less than the trial
just measured (it replaces at least one trial like it). The choice and its reason are kept in
``SearchResult.extra["evidence"]``.
"""

from __future__ import annotations

from dataclasses import asdict
from dataclasses import dataclass
from typing import Any

from batchfit.devices.base import Device
from batchfit.search.trial import Trial

TRACE_FAKE_TRIALS = 2  # two fake trials draw every storage's line (a third only where one is not a line)
EXPENSIVE_STEP_SECONDS = 0.05  # a device that says a step costs this much: the trace goes first
# What fake tensors cost, measured on a 2-core CPU with torch 2.13 (benchmarks/TRACE.md, "Seconds per
# op"): 0.12 to 0.15 ms per op of a real trial's timeline once warm (five models, 6 to 131 parameter
# tensors), and about 0.7 s the first time a process uses them (the fake mode's start-up). The
# constant is the low end of that range: a close call goes to the trace, which replaces a trial.
# Constants, not a calibration run: measuring them would cost the start-up the choice may avoid.
FAKE_OP_SECONDS = 1.2e-4
FAKE_START_SECONDS = 0.7


@dataclass(frozen=True)
class EvidenceChoice:
    """Whether the trace runs before (more) real trials, and why, with the figures behind it.

    >>> EvidenceChoice(True, "a real accelerator").to_dict()["trace_first"]
    True
    """

    trace_first: bool
    reason: str
    real_trial_seconds: float | None = None
    predicted_trace_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def before_any_trial(device: Device) -> EvidenceChoice | None:
    """The choice when the device alone decides it, else ``None`` (measure a real trial first).

    >>> from batchfit.devices.simulated import SimulatedDevice
    >>> before_any_trial(SimulatedDevice("1GiB")) is None
    True
    """
    if not device.simulated and device.torch_device.type not in ("cpu", "meta"):
        return EvidenceChoice(
            True, f"{device.name} is an accelerator: a real trial costs seconds and an OOM fragments it"
        )
    step_seconds = float(getattr(device, "step_seconds", 0.0) or 0.0)
    if step_seconds >= EXPENSIVE_STEP_SECONDS:
        return EvidenceChoice(True, f"each training step on {device.name} costs {step_seconds:g} s")
    return None


def after_first_trial(trial: Trial) -> EvidenceChoice:
    """The choice once the first real trial has run: no trace when it ran out of memory (every size
    left is smaller: no edge above it to estimate); else trace if the trace is predicted to cost less
    than that trial did (it replaces the second small trial the storages' lines need, one like
    it; see ``batchfit.search.lines_first``). The prediction: the trial's ops
    per step (its timeline's length) for ``TRACE_FAKE_TRIALS`` fake trials of two steps, at
    ``FAKE_OP_SECONDS`` each, plus the fake mode's start-up when this process has not paid it.
    A device that keeps no per-op record of its memory gives nothing to predict from: the trace goes first.

    >>> after_first_trial(Trial(1, True, 1024, 5.0, steps=2, timeline=tuple(range(2000)))).trace_first
    True
    >>> after_first_trial(Trial(2, False, None, 0.03, steps=2)).reason
    'batch size 2, the first size tried, ran out of memory, so batchfit measured the smaller sizes directly and skipped the estimate on fake tensors (it only helps above a size that fits)'
    """
    if not trial.fits:
        return EvidenceChoice(
            False,
            f"batch size {trial.batch_size}, the first size tried, ran out of memory, so batchfit measured the "
            "smaller sizes directly and skipped the estimate on fake tensors (it only helps above a size that fits)",
            real_trial_seconds=trial.seconds,
        )
    ops_per_step = len(trial.timeline or ()) / max(trial.steps, 1)
    if not ops_per_step:
        return EvidenceChoice(
            True,
            "this device does not record its memory operation by operation, so batchfit cannot tell whether an "
            "estimate on fake tensors would be quicker than more real trials: it ran the estimate first "
            "(trace=False or --no-trace skips it)",
            real_trial_seconds=trial.seconds,
        )
    predicted = TRACE_FAKE_TRIALS * 2 * ops_per_step * FAKE_OP_SECONDS + (
        0.0 if fake_mode_warm() else FAKE_START_SECONDS
    )
    figures = f"{predicted:.2g} s predicted against {trial.seconds:.2g} s"
    if predicted < trial.seconds:
        cheaper, reason = True, f"the trace would cost less than the real trial at {trial.batch_size} ({figures})"
    else:
        cheaper, reason = False, f"the trace would cost more than the real trial at {trial.batch_size} ({figures})"
    return EvidenceChoice(
        cheaper,
        reason,
        real_trial_seconds=trial.seconds,
        predicted_trace_seconds=predicted,
    )


def fake_mode_warm() -> bool:
    """Whether this process has run a trace already (the fake mode's start-up is paid)."""
    from batchfit.devices.trace import traced_before

    return traced_before()
