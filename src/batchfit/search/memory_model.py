"""MemoryModel: peak bytes against batch size B, fitted from trials, to jump to the edge.

The live bytes after any one op of a step are a line in B (each tensor either scales with the
batch or does not), so the peak is the maximum of one line per op. Two trials whose op
sequences match give every line, kinks included: at small B the backward peak may be set by
gradients and at large B by activations, which no single line through small trials sees. Where
a device records no per-op timeline, one line per phase (forward, backward, optimizer) stands
in; with a single trial, a conservative line treats everything above the held state as
growing with the batch. On a trace, where a size past the memory still reports its peak, the
lines through any two trials (``MemoryModel.between``) aim at the edge from both sides.

This module is where the search predicts an edge: ``MemoryModel`` from the trials' peaks, and
``StorageLines`` from every storage of two trials, where the device logs them (the live bytes
after every op, rounded and replayed through the caching allocator as the trials' own were).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from batchfit.devices.allocator_replay import events_from_lifetimes
from batchfit.devices.allocator_replay import replay
from batchfit.devices.allocator_replay import replay_loops
from batchfit.devices.caching_allocator import CachingAllocator
from batchfit.search.trial import Trial


def _least_squares_slope(points: Sequence[tuple[int, int]]) -> float:
    sizes = np.array([b for b, _ in points], dtype=float)
    peaks = np.array([p for _, p in points], dtype=float)
    centred = sizes - sizes.mean()
    return float((centred * (peaks - peaks.mean())).sum() / (centred**2).sum())


@dataclass(frozen=True)
class MemoryModel:
    """Lines ``bytes(B) = anchor_bytes + slope_bytes * (B - anchor_batch_size)``; the peak is their max.

    ``kind`` says what the lines were drawn through: ``"timeline"`` (one line per op, two trials whose ops
    match), ``"phases"`` (one per phase, least squares over the fitted trials), ``"conservative"`` (one
    trial: everything above the held bytes grows with the batch), or ``"between"`` (one per phase through
    two given trials, exact; see ``between``).

    >>> trials = [Trial(1, True, 110, 0.1, phase_peak_bytes={"backward": 110}),
    ...           Trial(3, True, 130, 0.1, phase_peak_bytes={"backward": 130})]
    >>> model = MemoryModel.fit(trials)
    >>> model.kind, model.max_batch_size(200)
    ('phases', 10)
    """

    anchor_batch_size: int
    anchor_bytes: np.ndarray
    slope_bytes: np.ndarray
    kind: str

    @classmethod
    def fit(cls, trials: Sequence[Trial]) -> MemoryModel | None:
        """The model through the largest fitting trial, or ``None`` when nothing fitted."""
        fitted = sorted((t for t in trials if t.fits and t.phase_peak_bytes), key=lambda t: t.batch_size)
        if not fitted:
            return None
        return (cls._from_timelines(fitted) or cls._from_phases(fitted)).with_reserved_line(fitted)

    @classmethod
    def between(cls, low: Trial, high: Trial) -> MemoryModel | None:
        """The lines through two trials, one per phase both report (the step's peak where either reports no
        phases), anchored at ``low``; ``high`` may have run past the memory, where the device still knows its
        peak (a trace on fake tensors). Slopes are exact fractions, so the edge is exact to the byte. ``None``
        where either trial has no peak or both are the same size.

        >>> model = MemoryModel.between(Trial(1, True, 300, 0.1), Trial(4, False, 1300, 0.1))
        >>> model.kind, model.max_batch_size(1000), model.max_batch_size(1300), model.predict_peak_bytes(3)
        ('between', 3, 4, 966.6666666666666)
        """
        low_points, high_points = _phase_points(low), _phase_points(high)
        phases = [phase for phase in low_points if phase in high_points]
        if not phases or low.batch_size == high.batch_size:
            return None
        run = high.batch_size - low.batch_size
        slopes = [Fraction(high_points[phase] - low_points[phase], run) for phase in phases]
        tops = [low_points[phase] for phase in phases]
        return cls(low.batch_size, np.array(tops, dtype=object), np.array(slopes, dtype=object), "between")

    def with_reserved_line(self, fitted: list[Trial]) -> MemoryModel:
        """One more line, through the caching allocator's reserved peaks of the smallest and the largest fitted
        trials where the device reports them (far apart: reserved bytes grow in whole segments): on a GPU the
        reserved bytes reach the capacity first, so the edge the model aims at is the allocator's."""
        points = {t.batch_size: t.reserved_peak_bytes for t in fitted if t.reserved_peak_bytes is not None}
        if len(points) < 2:
            return self
        ordered = sorted(points.items())
        (low, low_bytes), (high, high_bytes) = ordered[0], ordered[-1]
        slope = (high_bytes - low_bytes) / (high - low)
        anchor = high_bytes + slope * (self.anchor_batch_size - high)
        return dataclasses.replace(
            self,
            anchor_bytes=np.append(self.anchor_bytes, anchor),
            slope_bytes=np.append(self.slope_bytes, slope),
        )

    @classmethod
    def _from_timelines(cls, fitted: list[Trial]) -> MemoryModel | None:
        anchor = fitted[-1]
        if anchor.timeline is None:
            return None
        partners = [t for t in fitted[:-1] if t.timeline is not None and len(t.timeline) == len(anchor.timeline)]
        if not partners:
            return None
        partner = partners[0]  # the farthest from the anchor: rounding noise matters least
        # Slopes from the unrounded bytes where the device has them: rounding to blocks can hide
        # a small tensor's growth between two small batches entirely.
        exact = anchor.exact_timeline is not None and partner.exact_timeline is not None
        top, bottom = (anchor.exact_timeline, partner.exact_timeline) if exact else (anchor.timeline, partner.timeline)
        slopes = (np.asarray(top, dtype=float) - np.asarray(bottom, dtype=float)) / (
            anchor.batch_size - partner.batch_size
        )
        return cls(anchor.batch_size, np.asarray(anchor.timeline, dtype=float), slopes, "timeline")

    @classmethod
    def _from_phases(cls, fitted: list[Trial]) -> MemoryModel:
        anchor = fitted[-1]
        tops, slopes = [], []
        for phase, top in anchor.phase_peak_bytes.items():
            points = [(t.batch_size, t.phase_peak_bytes[phase]) for t in fitted if phase in t.phase_peak_bytes]
            if len({size for size, _ in points}) >= 2:  # a slope needs two sizes (a size tried twice is one)
                slopes.append(_least_squares_slope(points))
            else:
                slopes.append((top - (anchor.held_bytes or 0)) / anchor.batch_size)
            tops.append(top)
        kind = "phases" if len(fitted) >= 2 else "conservative"
        return cls(anchor.batch_size, np.array(tops, dtype=float), np.array(slopes, dtype=float), kind)

    def predict_peak_bytes(self, batch_size: int) -> float:
        """The predicted peak at ``batch_size``."""
        return float((self.anchor_bytes + self.slope_bytes * (batch_size - self.anchor_batch_size)).max())

    def max_batch_size(self, limit_bytes: int) -> int | None:
        """The largest batch whose predicted peak stays within ``limit_bytes`` (``None``: no line rises)."""
        line = self._binding(limit_bytes)
        if line is None:
            return None
        return self.anchor_batch_size + math.floor((limit_bytes - self.anchor_bytes[line]) / self.slope_bytes[line])

    def binding_line(self, limit_bytes: int) -> tuple[float, float] | None:
        """The line that reaches ``limit_bytes`` first, which decides the edge: ``(bytes at batch 0, bytes per
        sample)`` (``None``: no line rises).

        >>> MemoryModel(4, np.array([500.0, 900.0]), np.array([100.0, 10.0]), "phases").binding_line(1000)
        (100.0, 100.0)
        """
        line = self._binding(limit_bytes)
        if line is None:
            return None
        slope = float(self.slope_bytes[line])
        return float(self.anchor_bytes[line]) - slope * self.anchor_batch_size, slope

    def _binding(self, limit_bytes: int) -> int | None:
        rising = np.flatnonzero(self.slope_bytes > 0)
        if not len(rising):
            return None
        room = (limit_bytes - self.anchor_bytes[rising]) / self.slope_bytes[rising]
        return int(rising[int(np.argmin(room))])


def _phase_points(trial: Trial) -> dict[str, int]:
    """A trial's peak by phase, or its step's peak alone where it reports no phases (nothing without a peak)."""
    if trial.phase_peak_bytes:
        return dict(trial.phase_peak_bytes)
    return {} if trial.peak_bytes is None else {"step": trial.peak_bytes}


@dataclass(frozen=True)
class StorageRecord:
    """Every storage one trial made, for ``StorageLines``: the index of the first timeline entry
    that counts it (``born``), of the first that no longer does (``freed``; the timeline's length
    if it outlived the trial), and its bytes before rounding; with the trial's batch size, its
    rounded ``timeline`` and its peak.
    """

    batch_size: int
    born: np.ndarray
    freed: np.ndarray
    nbytes: np.ndarray
    timeline: np.ndarray
    peak_bytes: int
    events: np.ndarray | None = None  # the order storages were made and freed (``LiveBytes.event_log``)
    allocator_start: CachingAllocator | None = None  # the modelled caching allocator as the trial began
    marks: tuple[tuple[int, str], ...] | None = None  # where its steps began and phases ended (``step_marks``)


@dataclass(frozen=True)
class StorageLines:
    """Each storage's bytes as a line in the batch size B, from two trials whose ops match one for
    one: the live bytes after every op at any B, each storage rounded as the allocator rounds it.

    Where ``MemoryModel`` fits one line per op through rounded totals (and must verify near the
    edge, as rounding bends them), this reproduces the rounded timeline itself: the largest B
    whose every op stays within the limit is the edge, found without another trial.

    >>> low = StorageRecord(2, np.array([0, 1]), np.array([2, 2]), np.array([100, 8]), np.array([612, 1124]), 1124)
    >>> high = StorageRecord(3, np.array([0, 1]), np.array([2, 2]), np.array([150, 8]), np.array([612, 1124]), 1124)
    >>> lines = StorageLines.fit(low, high, lambda n: -(-n // 512) * 512)
    >>> lines.timeline(11).tolist(), lines.max_batch_size(1700, 3, 100), lines.proportional
    ([1124, 1636], 20, True)
    """

    base: StorageRecord
    slope_bytes: np.ndarray
    rounded: Callable[[np.ndarray], np.ndarray]

    @classmethod
    def fit(
        cls, low: StorageRecord, high: StorageRecord, rounded: Callable[[np.ndarray], np.ndarray]
    ) -> StorageLines | None:
        """The lines through ``low`` and ``high`` (``rounded``: the allocator's rounding of an array
        of sizes), or ``None`` when their ops or storages differ or the lines miss either timeline."""
        same_ops = len(low.timeline) == len(high.timeline) and len(low.born) == len(high.born)
        if not same_ops or not (np.array_equal(low.born, high.born) and np.array_equal(low.freed, high.freed)):
            return None
        steps = high.batch_size - low.batch_size
        growth = high.nbytes - low.nbytes
        if steps <= 0 or (growth % steps).any():
            return None
        lines = cls(low, growth // steps, rounded)
        return lines if lines.matches(low) and lines.matches(high) else None

    @property
    def proportional(self) -> bool:
        """Whether every storage is a fixed size or grows in proportion to B (no line with both an
        offset and a slope, such as a workspace rounded to pages or a B x B matrix seen at two sizes):
        then the lines hold at every B as they hold at the two trials."""
        offsets = self.base.nbytes - self.slope_bytes * self.base.batch_size
        return bool(((offsets == 0) | (self.slope_bytes == 0)).all())

    def bounded(self) -> StorageLines:
        """Lines no lower than these past the base trial wherever a size grows less than in
        proportion: each line with both an offset and a slope grows from the base trial's size as
        if it were in proportion to B (a page-rounded workspace does at most that), others stay."""
        base = self.base
        offsets = base.nbytes - self.slope_bytes * base.batch_size
        mixed = (offsets != 0) & (self.slope_bytes != 0)
        slopes = np.where(mixed, np.maximum(self.slope_bytes, base.nbytes / base.batch_size), self.slope_bytes)
        return StorageLines(base, slopes, self.rounded)

    def at(self, batch_size: int) -> StorageLines:
        """The same lines, based at ``batch_size``: its predicted storages and timeline (the order of requests
        and the allocator's starting state stay the base trial's)."""
        record = dataclasses.replace(
            self.base, batch_size=batch_size, nbytes=self._sizes(batch_size), timeline=self.timeline(batch_size)
        )
        return StorageLines(record, self.slope_bytes, self.rounded)

    def _sizes(self, batch_size: int) -> np.ndarray:
        grown = self.base.nbytes + np.ceil(self.slope_bytes * (batch_size - self.base.batch_size))
        return grown.astype(np.int64)

    def timeline(self, batch_size: int) -> np.ndarray:
        """The predicted live bytes after every op at ``batch_size``, rounded like the trials'."""
        base = self.base
        sizes = self._sizes(batch_size)
        change = (self.rounded(sizes) - self.rounded(base.nbytes)).astype(float)
        length = len(base.timeline)
        steps = np.bincount(base.born, change, length + 1) - np.bincount(base.freed, change, length + 1)
        return base.timeline + np.cumsum(steps[:length]).astype(np.int64)

    def peak_bytes(self, batch_size: int) -> int:
        """The predicted peak at ``batch_size``: the highest live bytes after any op."""
        return int(self.timeline(batch_size).max(initial=0))

    def matches(self, record: StorageRecord) -> bool:
        """Whether ``record`` (a trial with the same ops) is what the lines predict, op for op."""
        if record.peak_bytes != int(record.timeline.max(initial=0)) or len(record.timeline) != len(self.base.timeline):
            return False
        return bool(np.array_equal(self.timeline(record.batch_size), record.timeline))

    def max_batch_size(self, limit_bytes: int, fitting: int, largest: int) -> int:
        """The largest B in ``[fitting, largest]`` whose predicted peak stays within ``limit_bytes``,
        by bisection; ``fitting`` is a size known to fit."""
        return _bisect(lambda size: self.peak_bytes(size) <= limit_bytes, fitting, largest)

    def served(self, batch_size: int) -> bool:
        """Whether the caching allocator the trials ran on would serve every request of the training loop at
        ``batch_size``: the base trial's requests and frees, in its order, with the storages' sizes at
        ``batch_size``, replayed from the allocator's state as that trial began; where the trial logged its
        steps, as each order of loop runs them, for as many steps as the allocator takes to settle
        (``replay_loops``)."""
        base, start = self.base, self.base.allocator_start
        if start is None:
            return True
        if base.marks is None or base.events is None:
            return replay(start, self.event_order(), self._sizes(batch_size)).served
        return replay_loops(start, base.events, self._sizes(batch_size), marks=base.marks).served

    def event_order(self) -> np.ndarray:
        """The base trial's order of requests and frees, or (where it logged none) one drawn from lifetimes."""
        base = self.base
        if base.events is not None:
            return base.events
        return events_from_lifetimes(base.born, base.freed, len(base.timeline))

    def with_start(self, allocator: CachingAllocator) -> StorageLines:
        """The same lines, replayed from ``allocator`` (another allocator's state at the trial's start)."""
        return dataclasses.replace(self, base=dataclasses.replace(self.base, allocator_start=allocator))

    def max_served_batch_size(self, fitting: int, largest: int) -> int:
        """The largest B in ``[fitting, largest]`` the allocator serves (``largest``: where the live bytes alone
        would still fit, the usual answer; ``fitting`` is served): galloping down from ``largest`` (1, 2, 4, ...
        below it) to a size served, then bisecting above it. A size the allocator cannot serve fails within a
        few steps of the loop, one it serves is run until the cache settles, so most sizes tried are the first."""
        if largest <= fitting or self.served(largest):
            return max(largest, fitting)
        failing, gap = largest, 1  # failing: the lowest size seen not served
        while (held := max(largest - gap, fitting)) > fitting and not self.served(held):
            failing, gap = held, gap * 2
        return _bisect(self.served, held, failing - 1)


def _bisect(fits: Callable[[int], bool], fitting: int, largest: int) -> int:
    """The largest B in ``[fitting, largest]`` where ``fits`` holds, taking it to hold up to an edge."""
    lo, hi = fitting, largest + 1  # lo fits; hi is past the range or does not fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
