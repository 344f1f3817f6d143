"""What the checkpointing frontier returns: per activation-checkpointing policy, the largest micro-batch and the
throughput measured across micro-batches (``PolicyFrontier``); for a target global batch, each policy's best
(micro-batch, accumulation) and the one chosen (``FrontierChoice``); and all of it (``CheckpointingFrontier``).

The choice, by measured throughput: each policy's exact splits of the global batch per device (micro-batch x
accumulation steps = global batch / devices) whose micro-batch fits (as a later micro-batch of the window,
its gradients held, where it accumulates) are compared by the samples per second timed at that micro-batch;
the policy recomputing least within ``tolerance`` of the fastest is chosen. Each micro-batch is timed as a
full training step, its optimizer step timed on its own within it, and a window of ``a`` micro-batches is
charged one optimizer step: ``a`` full steps less ``a - 1`` optimizer steps (``window_seconds``).
Where nothing was timed (a trace for a GPU preset), the choice is by memory, as the per-rank plan chooses: no
checkpointing where a split fits without it, else the fewest accumulation steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.devices.units import format_bytes
from batchfit.errors import NoBatchFitsError
from batchfit.step.checkpointing import recompute_rank
from batchfit.throughput.result import ThroughputPoint
from batchfit.throughput.result import ThroughputResult


def divisors_up_to(count: int, ceiling: int) -> list[int]:
    """The divisors of ``count`` that are at most ``ceiling``, largest first.

    >>> divisors_up_to(96, 40)
    [32, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    """
    found = set()
    for low in range(1, int(count**0.5) + 1):
        if count % low == 0:
            found.update((low, count // low))
    return sorted((d for d in found if d <= ceiling), reverse=True)


@dataclass(frozen=True)
class PolicyFrontier:
    """One policy: its largest micro-batch for one plain step (``largest_batch_size``, 0 where even the
    smallest did not fit), the largest as a later micro-batch of an accumulation window
    (``accumulating_batch_size``, ``None`` where it was not searched), the peak at the largest, and the
    throughput timed across micro-batches (``None`` where nothing was timed)."""

    policy: str
    largest_batch_size: int
    accumulating_batch_size: int | None = None
    largest_peak_bytes: int | None = None
    throughput: ThroughputResult | None = None

    def point(self, batch_size: int) -> ThroughputPoint | None:
        """The point timed at ``batch_size``, or ``None``."""
        points = self.throughput.points if self.throughput is not None else []
        return next((p for p in points if p.batch_size == batch_size), None)

    def limit(self, accumulation_steps: int) -> int:
        """The largest micro-batch usable with ``accumulation_steps``: a later micro-batch of a window holds the
        window's gradients, so it is ``accumulating_batch_size`` where that was searched."""
        if accumulation_steps > 1 and self.accumulating_batch_size is not None:
            return self.accumulating_batch_size
        return self.largest_batch_size

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, with the throughput result's where there is one."""
        return {
            "policy": self.policy,
            "largest_batch_size": self.largest_batch_size,
            "accumulating_batch_size": self.accumulating_batch_size,
            "largest_peak_bytes": self.largest_peak_bytes,
            "throughput": self.throughput.to_dict() if self.throughput is not None else None,
        }


@dataclass(frozen=True)
class FrontierChoice:
    """A policy at one micro-batch: ``accumulation_steps`` micro-batches on each of ``devices`` make
    ``global_batch_size`` (``None`` without a target: the policy's throughput-optimal micro-batch);
    ``samples_per_second`` over all devices and ``step_seconds`` of one micro-batch as timed (``None``
    where nothing was timed); ``peak_bytes`` at that micro-batch."""

    policy: str
    micro_batch_size: int
    accumulation_steps: int = 1
    devices: int = 1
    global_batch_size: int | None = None
    samples_per_second: float | None = None
    step_seconds: float | None = None
    peak_bytes: int | None = None
    optimizer_seconds: float | None = None
    """The optimizer step's own seconds, where it was timed (side by side): a window runs it once."""

    @property
    def optimizer_step_seconds(self) -> float | None:
        """Seconds per optimizer step (one window): the accumulation steps times one micro-batch's timed step,
        less the optimizer steps that all but the window's last micro-batch skip (where they were timed)."""
        if self.step_seconds is None:
            return None
        return window_seconds(self.step_seconds, self.optimizer_seconds, self.accumulation_steps)

    @property
    def split(self) -> str:
        """The micro-batch and accumulation steps, ``32 x 2``; without a target, ``batch 32``."""
        if self.global_batch_size is None:
            return f"batch {self.micro_batch_size}"
        return f"{self.micro_batch_size} x {self.accumulation_steps}"

    def describe(self) -> str:
        """One phrase: ``full: 32 x 2 accumulation steps (1,234 samples/s)``, or ``full: batch 32 (...)``."""
        rate = f" ({self.samples_per_second:,.1f} samples/s)" if self.samples_per_second is not None else ""
        if self.global_batch_size is None:
            return f"{self.policy}: {self.split}{rate}"
        steps = "step" if self.accumulation_steps == 1 else "steps"
        return f"{self.policy}: {self.split} accumulation {steps}{rate}"


def window_seconds(step_seconds: float, optimizer_seconds: float | None, accumulation_steps: int) -> float:
    """One window's seconds: ``accumulation_steps`` micro-batches, the optimizer step only after the last.

    >>> round(window_seconds(0.05, 0.01, 4), 6)  # 4 x 0.05 s, less the 3 optimizer steps a window does not run
    0.17
    """
    skipped = (accumulation_steps - 1) * (optimizer_seconds or 0.0)
    return accumulation_steps * step_seconds - skipped


def _timed(frontier: PolicyFrontier, micro: int, steps: int, devices: int, target: int | None) -> FrontierChoice:
    """The split ``micro`` x ``steps`` at the policy's timing of ``micro``: a window of ``steps`` micro-batches
    runs its optimizer step once, where the optimizer step was timed on its own."""
    point = frontier.point(micro)
    if point is None:
        return FrontierChoice(frontier.policy, micro, steps, devices, target)
    window = window_seconds(point.step_seconds, point.optimizer_seconds, steps)
    samples = micro * steps / window * devices if window > 0 else point.samples_per_second * devices
    return FrontierChoice(
        frontier.policy, micro, steps, devices, target, samples, point.step_seconds, point.peak_bytes,
        point.optimizer_seconds,
    )  # fmt: skip


def policy_candidate(
    frontier: PolicyFrontier, global_batch_size: int | None, devices: int = 1
) -> FrontierChoice | None:
    """The policy's best way to the global batch: the exact split (micro-batch x accumulation steps = the
    global batch per device) whose micro-batch fits and was timed fastest, else (nothing timed) the one with
    the fewest accumulation steps; without a target, the throughput-optimal micro-batch (else the largest).
    ``None`` where no split fits.

    >>> policy_candidate(PolicyFrontier("full", 40, 24), 96).describe()
    'full: 24 x 4 accumulation steps'
    """
    if frontier.largest_batch_size < 1:
        return None
    if global_batch_size is None:
        chosen = frontier.throughput.batch_size if frontier.throughput is not None else frontier.largest_batch_size
        return _timed(frontier, chosen, 1, devices, None)
    per_device = global_batch_size // devices
    splits = [(d, per_device // d) for d in divisors_up_to(per_device, frontier.largest_batch_size)]
    splits = [(micro, steps) for micro, steps in splits if micro <= frontier.limit(steps)]
    options = [_timed(frontier, micro, steps, devices, global_batch_size) for micro, steps in splits]
    timed = [o for o in options if o.samples_per_second is not None]
    if timed:
        return max(timed, key=lambda o: (o.samples_per_second, o.micro_batch_size))
    return options[0] if options else None


def choose(candidates: list[FrontierChoice], tolerance: float) -> tuple[FrontierChoice, str]:
    """The candidate to use and why: where they were timed, the one recomputing least within ``tolerance``
    of the most samples per second; else no checkpointing where it fits, else the fewest accumulation steps.

    >>> a = FrontierChoice("none", 8, 4, samples_per_second=100.0)
    >>> b = FrontierChoice("full", 32, 1, samples_per_second=103.0)
    >>> choose([a, b], 0.05)[0].policy, choose([a, b], 0.01)[0].policy
    ('none', 'full')
    """
    if not candidates:
        raise NoBatchFitsError("no micro-batch reaches the global batch with any policy measured", [])
    timed = [c for c in candidates if c.samples_per_second is not None]
    if timed:
        best = max(c.samples_per_second for c in timed)
        near = [c for c in timed if c.samples_per_second >= (1 - tolerance) * best]
        chosen = min(near, key=lambda c: (recompute_rank(c.policy), -c.samples_per_second))
        way = "reaches the global batch" if chosen.global_batch_size is not None else "runs its best batch"
        return chosen, (
            f"It {way} with the most samples per second measured, recomputing least within "
            f"{tolerance:.0%} of the fastest ({best:,.1f} samples/s)."
        )
    plain = [c for c in candidates if c.policy == "none"]
    if plain:
        return plain[0], "Nothing was timed: a split fits without checkpointing, which recomputes nothing."
    chosen = min(candidates, key=lambda c: (c.accumulation_steps, recompute_rank(c.policy)))
    return chosen, "Nothing was timed: it needs the fewest accumulation steps."


@dataclass
class CheckpointingFrontier:
    """Every policy measured (``policies``), each one's best candidate (``candidates``) and the ``choice``
    with its ``reason``; ``timed`` says whether throughput was measured (not on a trace)."""

    policies: list[PolicyFrontier]
    candidates: list[FrontierChoice]
    choice: FrontierChoice
    reason: str
    device: str
    timed: bool
    global_batch_size: int | None = None
    devices: int = 1
    tolerance: float = 0.05
    notes: list[str] = field(default_factory=list)

    def for_global_batch(self, global_batch_size: int | None, devices: int = 1) -> CheckpointingFrontier:
        """The same measurements chosen from for another target: only micro-batches that were timed (or, on a
        trace, that fit) count, and a later micro-batch's limit is known only where it was searched."""
        candidates = [c for f in self.policies if (c := policy_candidate(f, global_batch_size, devices)) is not None]
        choice, reason = choose(candidates, self.tolerance)
        return CheckpointingFrontier(
            self.policies,
            candidates,
            choice,
            reason,
            self.device,
            self.timed,
            global_batch_size,
            devices,
            self.tolerance,
            list(self.notes),
        )

    def summary(self) -> str:
        """One sentence: the policy, micro-batch and accumulation to use, and why."""
        target = f" for a global batch of {self.global_batch_size}" if self.global_batch_size else ""
        return f"Use activation checkpointing {self.choice.describe()}{target}. {self.reason}"

    def rows(self) -> list[dict[str, Any]]:
        """One row per policy: its largest micro-batch (plain and accumulating), its fastest timed point, and its
        candidate for the target."""
        by_policy = {c.policy: c for c in self.candidates}
        rows = []
        for frontier in self.policies:
            best = frontier.throughput.point(frontier.throughput.best_batch_size) if frontier.throughput else None
            candidate = by_policy.get(frontier.policy)
            rows.append(
                {
                    "policy": frontier.policy,
                    "largest_batch_size": frontier.largest_batch_size,
                    "accumulating_batch_size": frontier.accumulating_batch_size,
                    "largest_peak": format_bytes(frontier.largest_peak_bytes) if frontier.largest_peak_bytes else None,
                    "best_batch_size": best.batch_size if best else None,
                    "best_samples_per_second": best.samples_per_second if best else None,
                    "split": candidate.split if candidate else "does not fit",
                    "samples_per_second": candidate.samples_per_second if candidate else None,
                    "chosen": candidate is not None and candidate == self.choice,
                }
            )
        return rows

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the choice, every candidate, every policy's measurements and the notes."""
        return {
            "device": self.device,
            "timed": self.timed,
            "global_batch_size": self.global_batch_size,
            "devices": self.devices,
            "tolerance": self.tolerance,
            "choice": {**vars(self.choice), "optimizer_step_seconds": self.choice.optimizer_step_seconds},
            "reason": self.reason,
            "candidates": [vars(c) for c in self.candidates],
            "policies": [p.to_dict() for p in self.policies],
            "notes": list(self.notes),
        }
