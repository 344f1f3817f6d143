"""The trace's first guess at the edge, from as few fake trials as the lines allow.

A fake trial costs about the same at every batch size, so the trace's cost is its number of
trials. Every storage a step makes has bytes that are a fixed size or grow in proportion to the
batch size B, and lives from one op to another whatever B is; so two fake trials whose ops match
one for one (at 2 and 3: batch 1 may take other ops) give every storage's line, hence the live
bytes after every op at any B, each storage rounded as the allocator rounds it
(``StorageLines``), and the edge: the largest B whose every op stays within the limit. It is the
edge the search on fake trials finds, without its trials. Where some size is not so (a workspace
rounded to pages, a B x B matrix), or the ops differ, the search on fake trials goes on from the
two trials. The lines assume the step runs the same ops at every batch size from 2 on; the real
trials after the trace check the edge either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from batchfit.devices.accounting import LiveBytes
from batchfit.devices.trace import TraceDevice
from batchfit.search.memory_model import StorageLines
from batchfit.search.memory_model import StorageRecord
from batchfit.search.strategies import Auto
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import bracket
from batchfit.search.trial import Trial

LARGE_BLOCK_OVER_BYTES = 2**20  # LiveBytes rounds storages over 1 MiB to its large block
FIRST_LINE_BATCH_SIZE = 2  # batch 1 may take other ops (a squeezed dimension): lines start at 2


class StorageLog(LiveBytes):
    """``LiveBytes`` that also notes, for the trial under way (from ``mode()``), each storage it
    starts counting: the timeline entry it first counts in, the one it is freed before, its bytes."""

    def __init__(self, **options: Any):
        super().__init__(**options)
        self._restart()

    @classmethod
    def like(cls, counter: LiveBytes) -> StorageLog:
        """A log that counts as ``counter`` does (limit, rounding, name)."""
        return cls(
            limit_bytes=counter.limit_bytes,
            rounding_bytes=counter.rounding_bytes,
            name=counter.name,
            large_rounding_bytes=counter.large_rounding_bytes,
        )

    def _restart(self) -> None:
        self._born: list[int] = []
        self._freed: list[int] = []
        self._nbytes: list[int] = []
        self._open: dict[int, int] = {}  # storage key -> its index in the lists, while it lives

    def mode(self, uncounted: Any = ()) -> Any:
        self._restart()
        return super().mode(uncounted)

    def track(self, tensor: Any) -> int:
        added = super().track(tensor)
        if added:
            storage = tensor.untyped_storage()
            self._open[storage._cdata] = len(self._born)
            self._born.append(len(self.timeline))
            self._freed.append(-1)
            self._nbytes.append(storage.nbytes())
        return added

    def _release(self, key: int, nbytes: int, exact_nbytes: int) -> None:
        index = self._open.pop(key, None)
        if index is not None:
            self._freed[index] = len(self.timeline)
        super()._release(key, nbytes, exact_nbytes)

    def record(self, trial: Trial) -> StorageRecord:
        """The storages of the trial that just ran (``trial``, which fitted)."""
        length = len(trial.timeline or ())
        freed = np.array(self._freed, dtype=np.int64)
        return StorageRecord(
            batch_size=trial.batch_size,
            born=np.array(self._born, dtype=np.int64),
            freed=np.where(freed < 0, length, freed),
            nbytes=np.array(self._nbytes, dtype=np.int64),
            timeline=np.array(trial.timeline or (), dtype=np.int64),
            peak_bytes=int(trial.peak_bytes or 0),
        )

    def rounded(self, sizes: np.ndarray) -> np.ndarray:
        """``sizes`` rounded up to the blocks this counter counts them in."""
        block = np.full_like(sizes, self.rounding_bytes)
        if self.large_rounding_bytes is not None:
            block = np.where(sizes > LARGE_BLOCK_OVER_BYTES, self.large_rounding_bytes, block)
        return -(-sizes // block) * block


def logging_trace_device(limit_bytes: int, device: Any) -> tuple[TraceDevice, StorageLog]:
    """A ``TraceDevice`` of ``limit_bytes`` (fake tensors claiming ``device``'s type) whose counter
    is a ``StorageLog``, and that log."""
    tracer = TraceDevice(limit_bytes, device=device)
    log = StorageLog.like(tracer.counter)
    tracer.counter = log
    return tracer, log


class LinesFirst:
    """The trace's strategy: fake trials at 2 and 3 (or the minimum and one more) and the edge
    from the storages' lines (``StorageLines``). Where some line has both an offset and a slope
    (a size that may not be a line in B), a third trial aims at the edge of lines no lower than
    these, and ``Auto`` goes on from there; it also takes over when the lines cannot be drawn.
    ``edge`` is the lines' answer, if they gave one; ``method`` says what found the edge:
    ``"lines"`` or ``"search"``."""

    name = "lines"

    def __init__(self, log: StorageLog):
        self.log = log
        self.records: list[StorageRecord | None] = []
        self.fallback: Auto | None = None
        self.method = "lines"
        self.edge: int | None = None

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if len(self.records) < len(trials):  # the trial that just ran: its storages, while the log holds them
            last = trials[-1]
            self.records.append(self.log.record(last) if last.fits and last.timeline is not None else None)
        if self.fallback is None:
            proposal = self._by_lines(trials, space)
            if self.fallback is None:
                return proposal
            if proposal is not None:
                return proposal
        return self.fallback.next(trials, space)

    def _hand_over(self, proposal: int | None = None) -> int | None:
        """From now on ``Auto`` proposes, from the trials so far; ``proposal`` first, if any."""
        self.fallback, self.method = Auto(), "search"
        return proposal

    def _by_lines(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        """The next size by the lines; ``None`` when the edge is found."""
        first = max(space.min_batch_size, min(FIRST_LINE_BATCH_SIZE, space.max_batch_size))
        if not trials:
            return first
        lo, hi = bracket(trials, space)
        if lo < space.min_batch_size:
            return self._hand_over()  # the first size failed: the search goes down from it
        if hi - lo <= 1:
            self.edge = lo
            return None
        if len(trials) == 1:
            return first + 1
        return self._aim(space)

    def _aim(self, space: SearchSpace) -> int | None:
        """After the two line trials, which fitted: the edge when the lines hold at every size,
        else a first aim for the search (at most the edge of lines no lower than these)."""
        low, high = self.records
        lines = StorageLines.fit(low, high, self.log.rounded) if low is not None and high is not None else None
        if lines is None or space.limit_bytes is None:
            return self._hand_over()
        if lines.proportional:
            self.edge = lines.max_batch_size(space.limit_bytes, high.batch_size, space.max_batch_size)
            return None
        safe = lines.at(high.batch_size).bounded()
        aim = safe.max_batch_size(space.limit_bytes, high.batch_size, space.max_batch_size)
        return self._hand_over(min(max(aim, high.batch_size + 1), space.max_batch_size))
