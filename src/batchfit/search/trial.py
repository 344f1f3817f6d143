"""Trial: the outcome of one probe at one batch size."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.devices.byte_format import format_bytes


@dataclass(frozen=True)
class Trial:
    """One probe: did ``batch_size`` fit, at what peak, in how long.

    ``peak_bytes`` is the absolute peak (model included) over all steps, ``None`` after an OOM;
    ``phase_peak_bytes`` splits it by phase (``forward``, ``backward``, ``optimizer``);
    ``failed_phase`` names the phase an OOM struck in (``forward`` also covers building the batch);
    ``steps`` counts the full steps that completed; ``oom`` tells a real out-of-memory error from
    a peak over the usable memory (capacity minus margin); ``held_bytes`` is what was live at the
    start of the last step apart from the batch (parameters, buffers, optimizer state);
    ``timeline`` holds the live bytes after every op, where the device records them, and
    ``exact_timeline`` the same before allocator rounding; ``step_seconds`` times each full step and
    ``optimizer_seconds`` its optimizer step and ``zero_grad`` alone (what a later micro-batch of an accumulation
    window does not run);
    ``reserved_peak_bytes`` is the caching allocator's reserved peak where the device has one (a GPU, or a
    simulated device that models it): at least the peak of live bytes, and what the card must hold.
    Where the device models the caching allocator, ``loop_steps`` counts the steps of the training loop
    the model ran (the trial's own, then its last again: ``batchfit.devices.allocator_replay``) and
    ``settled`` says whether the allocator's state repeated within them, so every later step is served
    as one of them was; after an out-of-memory error there, ``loop_steps`` is the step that met it.
    """

    batch_size: int
    fits: bool
    peak_bytes: int | None
    seconds: float
    error: str | None = None
    phase_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    steps: int = 0
    oom: bool = False
    held_bytes: int | None = None
    timeline: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    exact_timeline: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    failed_phase: str | None = None
    step_seconds: tuple[float, ...] = ()
    reserved_peak_bytes: int | None = None
    loop_steps: int | None = None
    settled: bool | None = None
    optimizer_seconds: tuple[float, ...] = ()

    def summary(self) -> str:
        """One line: the size, whether it fitted, and the peak.

        >>> Trial(28, True, 5 * 2**30, 0.4).summary()
        'batch size 28: fits, peak 5.0 GiB'
        >>> Trial(29, False, None, 0.1, "CUDA out of memory", oom=True, failed_phase="backward").summary()
        'batch size 29: does not fit (out of memory in backward)'
        """
        if self.fits:
            return f"batch size {self.batch_size}: fits, peak {format_bytes(self.peak_bytes)}"
        reason = f"out of memory in {self.failed_phase}" if self.oom else f"peak {format_bytes(self.peak_bytes)}"
        return f"batch size {self.batch_size}: does not fit ({reason})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field but the per-op timelines (the ``trials`` items of the
        search result's schema)."""
        data = asdict(self)
        data["phase_peak_bytes"] = dict(self.phase_peak_bytes)
        del data["timeline"], data["exact_timeline"]  # one number per op: for the memory model only
        return data

    def describe(self, capacity_bytes: int | None = None) -> str:
        """A log line: ``✓ Batch size 28 fits — peak 5.2 GiB of 8.0 GiB (0.4 s)``."""
        if self.fits:
            of = f" of {format_bytes(capacity_bytes)}" if capacity_bytes else ""
            reserved = ""
            if self.reserved_peak_bytes is not None:
                reserved = f", {format_bytes(self.reserved_peak_bytes)} reserved"
            return (
                f"✓ Batch size {self.batch_size} fits — peak {format_bytes(self.peak_bytes)}{of}{reserved} "
                f"({self.seconds:.1f} s{self._loop_words()})"
            )
        reason = f"out of memory in {self.failed_phase}" if self.oom else (self.error or "does not fit")
        if self.oom and self.loop_steps is not None and self.loop_steps > self.steps:
            reason += f" at step {self.loop_steps} of the loop"
        return f"✗ Batch size {self.batch_size}: {reason}"

    def _loop_words(self) -> str:
        """How far the allocator model ran the loop past the trial's steps, where it did.

        >>> Trial(8, True, 100, 0.1, steps=2, loop_steps=9, settled=True)._loop_words()
        '; the loop settled by step 9'
        """
        if self.loop_steps is None or self.loop_steps <= self.steps:
            return ""
        return f"; the loop {'settled by' if self.settled else 'held'} step {self.loop_steps}"
