"""The edge from two small trials: every storage's bytes as a line in the batch size.

Every storage a step makes has bytes that are a fixed size or grow in proportion to the batch
size B, and lives from one op to another whatever B is; so two trials whose ops match one for
one (at 2 and 3: batch 1 may take other ops) give every storage's line, hence the live bytes
after every op at any B, each storage rounded as the allocator rounds it (``StorageLines``), and
the edge: the largest B whose every op stays within the limit. On a device that models the CUDA
caching allocator, the edge is also the largest B whose requests, replayed in the trial's order at
that size, the allocator serves: there fragmentation, not the live bytes, decides. Where some size is not so (a
workspace rounded to pages, a B x B matrix), or the ops differ, ``Auto`` goes on from the two
trials.

The trials may be fake (the trace: the edge found is its estimate, no more trials) or real (on a
device that counts every storage, such as ``SimulatedDevice``: the edge is then tried, and one
more, as any estimate is). Two real trials at 2 and 3 cost little next to the trials near the
edge, and the lines make the third trial land on it, where a single small trial could only
give a line through its peak.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchfit.devices.accounting import LiveBytes
from batchfit.search.memory_model import StorageLines
from batchfit.search.memory_model import StorageRecord
from batchfit.search.strategies import Auto
from batchfit.search.strategies import SearchSpace
from batchfit.search.strategies import bracket
from batchfit.search.trial import Trial

FIRST_LINE_BATCH_SIZE = 2  # batch 1 may take other ops (a squeezed dimension): lines start at 2


def storage_record(counter: LiveBytes, trial: Trial) -> StorageRecord:
    """The storages of ``trial`` (which just ran and fitted), as ``counter`` logged them."""
    born, freed, nbytes = counter.storage_log()
    timeline = list(trial.timeline or ())
    return StorageRecord(
        batch_size=trial.batch_size,
        born=born,
        freed=freed.clip(max=len(timeline)),
        nbytes=nbytes,
        timeline=np.array(timeline, dtype=np.int64),
        peak_bytes=int(trial.peak_bytes or 0),
        events=counter.event_log() if counter.allocator is not None else None,
        allocator_start=counter.allocator_at_start,
        marks=tuple(counter.step_marks()) if counter.allocator is not None else None,
    )


class LinesFirst:
    """Trials at 2 and 3 (or the minimum and one more), then the edge from the storages' lines
    (``StorageLines``). Where some line has both an offset and a slope (a size that may not be a
    line in B, such as a workspace rounded to pages), the next trial aims at the edge of lines no
    lower than these, and ``Auto`` goes on from there; it also takes over when the lines cannot
    be drawn.

    ``counter`` is the device's ``LiveBytes``. With ``verify=False`` (fake trials) the search ends
    at the lines' edge; with ``verify=True`` (real trials) ``Auto`` then tries the edge and one
    more. ``edge`` is the lines' answer, if they gave one; ``method`` says what found the edge:
    ``"lines"`` or ``"search"``. Where the device models a caching allocator without expandable
    segments, ``expandable_edge`` is the edge the lines give with them (what fragmentation costs).
    """

    def __init__(self, counter: LiveBytes, verify: bool = False):
        self.counter = counter
        self.verify = verify
        self.records: list[StorageRecord | None] = []
        self.fallback: Auto | None = None
        self.method = "lines"
        self.edge: int | None = None
        self.expandable_edge: int | None = None

    @property
    def name(self) -> str:
        return "auto" if self.verify else "lines"  # on real trials it is how ``auto`` begins

    def next(self, trials: Sequence[Trial], space: SearchSpace) -> int | None:
        if len(self.records) < len(trials):  # the trial that just ran: its storages, while the log holds them
            last = trials[-1]
            fitted = last.fits and last.timeline is not None
            self.records.append(storage_record(self.counter, last) if fitted else None)
        if self.fallback is None:
            proposal = self._by_lines(trials, space)
            if self.fallback is None:
                return proposal
            if proposal is not None:
                return proposal
        return self.fallback.next(trials, space)

    def _hand_over(self, proposal: int | None = None, guess: int | None = None) -> int | None:
        """From now on ``Auto`` proposes (with ``guess`` as its estimate); ``proposal`` first, if any."""
        self.fallback = Auto(guess=guess)
        if guess is None:
            self.method = "search"
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
        low, high = self.records[:2]
        lines = StorageLines.fit(low, high, self.counter.rounded) if low is not None and high is not None else None
        if lines is None or space.limit_bytes is None:
            return self._hand_over()
        if lines.proportional:
            self.edge = self._edge(lines, space, high.batch_size)
            self.expandable_edge = self._expandable_edge(lines, space, high.batch_size)
            return self._hand_over(guess=self.edge) if self.verify else None
        aim = self._edge(lines.at(high.batch_size).bounded(), space, high.batch_size)
        # With a caching allocator, Auto's own model (lines through the live bytes) would aim past the
        # allocator's edge: the lines' replayed edge is its estimate instead.
        guess = self._edge(lines, space, high.batch_size) if self.counter.allocator is not None else None
        return self._hand_over(min(max(aim, high.batch_size + 1), space.max_batch_size), guess=guess)

    def _edge(self, lines: StorageLines, space: SearchSpace, fitting: int) -> int:
        """The largest size whose live bytes stay within the limit and, where the device models a caching
        allocator, whose every request it serves (the requests replayed at that size)."""
        edge = lines.max_batch_size(space.limit_bytes, fitting, space.max_batch_size)
        if self.counter.allocator is None or edge <= fitting:
            return edge
        return lines.max_served_batch_size(fitting, edge)

    def _expandable_edge(self, lines: StorageLines, space: SearchSpace, fitting: int) -> int | None:
        """The edge with expandable segments where the device's allocator runs without them (else ``None``):
        the same requests replayed from the held blocks placed as that allocator would place them."""
        allocator = self.counter.allocator
        if allocator is None or allocator.settings.expandable_segments or lines.base.allocator_start is None:
            return None
        start = lines.base.allocator_start.rebuilt(allocator.settings.with_expandable_segments())
        edge = lines.max_batch_size(space.limit_bytes, fitting, space.max_batch_size)
        return lines.with_start(start).max_served_batch_size(fitting, edge)
