"""The largest micro-batch per rank under a capacity, from a few traces of one rank.

The search is the library's one search loop (``search_workload``) over one rank on a
``TraceDevice``, with the ``PhaseLines`` strategy: each phase's peak is a line in the micro-batch,
so the lines through the traces at 1 and 2 predict the edge, which is then confirmed by tracing it
and the size above it (see ``batchfit.search.phase_lines``). The answer is always a traced size
that fits next to a traced size that does not.

All sizes are traced on one ``RankSession``: the model is built and sharded once, and every size
after the first costs one steady training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.devices.trace import TraceDevice
from batchfit.devices.trace import trace_capacity_bytes
from batchfit.devices.units import format_bytes
from batchfit.errors import InputError
from batchfit.errors import NoBatchFitsError
from batchfit.parallel.models import ModelSpec
from batchfit.parallel.one_rank import ONE_RANK
from batchfit.parallel.one_rank import TOKEN_BYTES
from batchfit.parallel.one_rank import RankBackend
from batchfit.parallel.settings import Parallelism
from batchfit.parallel.trace import RankSession
from batchfit.parallel.trace import ShardedEstimate
from batchfit.search.phase_lines import PhaseLines
from batchfit.search.runner import search_workload


@dataclass(frozen=True)
class LargestBatch:
    """The largest micro-batch per rank whose traced peak fits ``capacity_bytes``: ``batch_size``
    (0 when even 1 does not fit), the trace at it (``estimate``; at 1 when none fits) and the
    trace one above it (``above``, over the capacity; ``None`` when ``max_batch_size`` fits)."""

    batch_size: int
    capacity_bytes: int
    estimate: ShardedEstimate
    above: ShardedEstimate | None
    traces: int
    """Sizes this search traced (not counting those it reused from ``known``)."""
    steps: int = 0
    """Training steps traced in all (the first size's warm-up steps, then one per later size)."""
    traced: Mapping[int, ShardedEstimate] = field(default_factory=dict, repr=False, compare=False)
    """Every size's trace the search saw, by size: what a search at another capacity reuses (``known``)."""

    def to_dict(self) -> dict[str, Any]:
        """``largest_batch_size``, the capacity, and both traces' dictionaries."""
        return {
            "largest_batch_size": self.batch_size,
            "capacity_bytes": self.capacity_bytes,
            "estimate": self.estimate.to_dict(),
            "above": None if self.above is None else self.above.to_dict(),
            "traces": self.traces,
            "steps": self.steps,
        }


class _SessionTraces:
    """What ``largest_batch_size`` searches: one rank's ``RankSession``, made before the search with the
    caller's options. Its backend (``RankBackend``) runs each trial on a ``TraceDevice`` as a trace of
    the session it gets from ``session``: this object, which keeps every trace by size, since the
    answer carries the estimates at its size and the one above, which trials do not."""

    def __init__(self, session: RankSession, name: str, known: Mapping[int, ShardedEstimate] | None = None):
        self._session, self.name, self._known = session, name, dict(known or {})
        self._open = False
        self.traced: dict[int, ShardedEstimate] = {}
        self.new_traces = 0

    def backend(self) -> RankBackend:
        return ONE_RANK

    def bytes_per_sample(self) -> int:
        return self._session.seq_len * TOKEN_BYTES

    def session(self, steps: int) -> _SessionTraces:
        """The session to trace in (made already, with the same ``steps`` as the search's)."""
        return self

    def __enter__(self) -> _SessionTraces:
        return self  # the session is built at the first size not already known

    def __exit__(self, *exc_info: object) -> None:
        if self._open:
            self._open = False
            self._session.__exit__(*exc_info)

    @property
    def model(self) -> Any:
        """The rank's sharded model, where this process holds it (not where a child process traces)."""
        return getattr(self._session, "model", None)

    @property
    def steps_run(self) -> int:
        return self._session.steps_run

    def trace(self, batch_size: int) -> ShardedEstimate:
        """The trace at ``batch_size``: a known one, or one traced in the session (built now if it is not yet)."""
        if batch_size in self._known:
            self.traced[batch_size] = self._known[batch_size]
            return self._known[batch_size]
        if not self._open:
            self._session.__enter__()
            self._open = True
        self.traced[batch_size] = estimate = self._session.trace(batch_size)
        self.new_traces += 1
        return estimate


def largest_batch_size(
    model: ModelSpec,
    seq_len: int,
    capacity: int | str,
    *,
    parallelism: Parallelism | None = None,
    max_batch_size: int = 1 << 16,
    known: Mapping[int, ShardedEstimate] | None = None,
    **trace_options: Any,
) -> LargestBatch:
    """The largest micro-batch of ``seq_len`` tokens one rank trains within ``capacity`` (bytes,
    ``"80GiB"`` or a GPU preset such as ``"h100-80gb"``: its usable memory), from ``trace_rank``
    traces (``trace_options`` are its keywords: ``dtype``, ``optimizer``, ``steps``, ``fake``).
    The model is built and sharded once (a ``RankSession``): the first size runs ``steps``
    steps, every later one a single steady step with the same peak as its own ``trace_rank``.
    A search led by the phases' lines usually traces four sizes (1, 2, the answer and the size
    above it): ``search_workload`` with the ``PhaseLines`` strategy, on a ``TraceDevice`` of the
    capacity (no cache, no agreement across ranks). ``known``: traces of this same model, ``seq_len``,
    parallelism and options (a search at another capacity: its ``LargestBatch.traced``), reused where the search
    asks for their sizes; the model is built and sharded only for a size not among them."""
    capacity_bytes = trace_capacity_bytes(capacity)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InputError(f"max_batch_size must be an integer of at least 1, got {max_batch_size!r}")
    name = model if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
    work = _SessionTraces(RankSession(model, seq_len, parallelism=parallelism, **trace_options), name, known)
    with contextlib.suppress(NoBatchFitsError):  # not even 1 fits: the answer is 0, with the trace at 1
        search_workload(
            work,
            device=TraceDevice(capacity_bytes),
            strategy=PhaseLines(),
            max_batch_size=max_batch_size,
            steps=trace_options.get("steps", 2),
            trace=False,
            cache=False,
            agree=False,
        )
    traced = {**(known or {}), **work.traced}
    fitting = [batch for batch, estimate in work.traced.items() if estimate.peak_bytes <= capacity_bytes]
    found = max(fitting, default=0)
    at, above = work.traced[found or 1], work.traced.get(found + 1) if found else None
    return LargestBatch(found, capacity_bytes, at, above, work.new_traces, work.steps_run, traced)


def describe(found: LargestBatch) -> str:
    """One sentence naming the answer and the capacity.

    >>> from batchfit.parallel.trace import ShardedEstimate
    >>> at = ShardedEstimate(2**30, {"activations": 2**30}, 8, 3, 4096, "backward", Parallelism(world_size=8))
    >>> describe(LargestBatch(3, 2**31, at, None, 3))
    'Up to micro-batch 3 x 4096 tokens per rank fits in 2.0 GiB over 8 ranks (1.0 GiB at 3).'
    """
    at = found.estimate
    if found.batch_size == 0:
        return f"Not even micro-batch 1 x {at.seq_len} tokens fits in {format_bytes(found.capacity_bytes)} per rank."
    return (
        f"Up to micro-batch {found.batch_size} x {at.seq_len} tokens per rank fits in "
        f"{format_bytes(found.capacity_bytes)} over {at.world_size} ranks ({format_bytes(at.peak_bytes)} at {found.batch_size})."
    )
