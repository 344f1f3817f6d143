"""ParallelSweep: the driver of a sweep fanned out on an engine (``batchfit.sweep.engines``).

It sends each configuration as a job (``ConfigJob``: picklable, run by ``run_job`` in a fresh process), the
grid's extremes first, then the rest, each with the records measured so far, so its start comes from the
memory model refitted as records arrive; it alone writes the results file (atomically, after every record)
and the result cache. A job whose process died is sent once more in a new process, then recorded as
``died``: never an out-of-memory bound. A re-run with the same results file sends only what is missing (a
record of a configuration that raised or died counts as missing) and first re-attaches to jobs an engine can
find again (Slurm's, by the ids kept beside the results file).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.files import atomic_write_text
from batchfit.search.cache import ResultCache
from batchfit.sweep.engines.base import Engine
from batchfit.sweep.engines.base import Handle
from batchfit.sweep.jobs import RETRIED_FAILURES
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import Death
from batchfit.sweep.jobs import Outcome
from batchfit.sweep.jobs import failed_record
from batchfit.sweep.results import SweepFile
from batchfit.sweep.results import SweepResult
from batchfit.sweep.results import config_key
from batchfit.sweep.results import describe
from batchfit.sweep.schedule import FITTED_AFTER
from batchfit.sweep.schedule import extremes_first

ATTEMPTS = 2  # a job whose process died is sent once more
POLL_S = 0.5


class JobTokens:
    """The engine's ids of the jobs in flight, beside the results file (``<results>.jobs.json``), so a
    driver started again re-attaches to them. Nothing is kept without a results file."""

    def __init__(self, results: Path | None):
        self.path = results.with_name(results.name + ".jobs.json") if results is not None else None
        self.tokens: dict[str, str] = {}
        if self.path is not None and self.path.is_file():
            try:
                self.tokens = dict(json.loads(self.path.read_text())["jobs"])
            except (ValueError, KeyError, TypeError):
                self.tokens = {}  # unreadable: every missing configuration is sent again

    def get(self, knobs: Mapping[str, Any]) -> str | None:
        return self.tokens.get(config_key(knobs))

    def set(self, knobs: Mapping[str, Any], token: str | None) -> None:
        key = config_key(knobs)
        if token is None and key not in self.tokens:
            return
        if token is None:
            del self.tokens[key]
        else:
            self.tokens[key] = token
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        if not self.tokens:
            self.path.unlink(missing_ok=True)
            return
        atomic_write_text(self.path, json.dumps({"jobs": self.tokens}, indent=1) + "\n")


class ParallelSweep:
    """Sends a grid's configurations to ``engine`` and keeps their records (see the module's doc).

    ``make_job(knobs, records)`` builds a configuration's job with the records measured so far; ``log``
    gets one line per event and the jobs' own lines, prefixed by their slot; ``progress`` the counts.
    """

    def __init__(
        self,
        engine: Engine,
        make_job: Callable[[dict[str, Any], tuple[dict[str, Any], ...]], ConfigJob],
        cache: ResultCache | None,
        log: Callable[[str], None],
        progress: Callable[[Mapping[str, int]], None] | None = None,
    ):
        self.engine, self.make_job, self.cache, self.log = engine, make_job, cache, log
        self.progress = progress
        self.file: SweepFile | None = None
        self.failed = self.done = 0
        self.extremes: set[str] = set()
        self.ran_on: Counter[str] = Counter()

    def run(self, configs: list[dict[str, Any]], file: SweepFile) -> SweepResult:
        self.file = file
        todo = [knobs for knobs in configs if self._missing(knobs)]
        queue, corners = extremes_first(todo)
        self.extremes = {config_key(knobs) for knobs in queue[:corners]}
        tokens = JobTokens(file.path)
        running = self._reattached(queue, tokens)
        self.done = len(configs) - len(todo)
        try:
            while queue or running:
                running += self._send(queue, running, tokens)
                for handle, ended in self.engine.poll(running, POLL_S):
                    running.remove(handle)
                    tokens.set(handle.job.knobs, None)
                    self._ended(handle, ended, queue)
                self._report(len(running))
        finally:
            self.engine.close()  # a clean end leaves nothing running; an error or Ctrl-C stops what does
        records = [file.done(knobs) for knobs in configs]
        slots = {slot: self.ran_on[slot] for slot in self.engine.slots()} | dict(self.ran_on)
        ran = {"engine": self.engine.name, "slots": slots}
        return SweepResult(records, list(configs[0]), file.header["device"]["name"], file.path, ran_on=ran)

    def _missing(self, knobs: dict[str, Any]) -> bool:
        assert self.file is not None
        done = self.file.done(knobs)
        if done is not None and done.get("failure") not in RETRIED_FAILURES:
            self.log(f"Already measured {describe(knobs)}: batch size {done['batch_size_used']} (resumed)")
            return False
        return True

    def _records(self) -> tuple[dict[str, Any], ...]:
        assert self.file is not None
        return tuple(r for r in self.file.records.values() if r.get("failure") not in RETRIED_FAILURES)

    def _reattached(self, queue: list[dict[str, Any]], tokens: JobTokens) -> list[Handle]:
        """Jobs an earlier driver sent that the engine finds again; the rest stay queued."""
        handles = []
        for knobs in list(queue):
            token = tokens.get(knobs)
            handle = None if token is None else self.engine.reattach(self.make_job(knobs, self._records()), token)
            if handle is not None:
                self.log(f"Re-attached to {describe(knobs)} ({self.engine.name} job {token})")
                queue.remove(knobs)
                handles.append(handle)
            elif token is not None:
                tokens.set(knobs, None)
        return handles

    def _ready(self, queue: list[dict[str, Any]], running: list[Handle]) -> list[dict[str, Any]]:
        """What may go now: the extremes at once; the rest once the memory model has its points, or once
        no extreme is left to give them."""
        fitted = sum(1 for r in self._records() if r.get("fits")) >= FITTED_AFTER
        extremes_left = any(config_key(k) in self.extremes for k in queue) or any(
            config_key(h.job.knobs) in self.extremes for h in running
        )
        return [k for k in queue if fitted or not extremes_left or config_key(k) in self.extremes]

    def _send(self, queue: list[dict[str, Any]], running: list[Handle], tokens: JobTokens) -> list[Handle]:
        ready = self._ready(queue, running)
        room = self.engine.room(len(running))
        batch = ready if room is None else ready[: max(room, 0)]
        if not batch:
            return []
        records = self._records()
        jobs = [queued.job if isinstance(queued, _Retry) else self.make_job(queued, records) for queued in batch]
        for knobs in batch:
            queue.remove(knobs)
        handles = self.engine.submit(jobs)
        for handle in handles:
            tokens.set(handle.job.knobs, handle.token)
            self.log(f"[{handle.slot}] Sent {handle.job.label}" + _attempt(handle.job))
        return handles

    def _ended(self, handle: Handle, ended: Outcome | Death, queue: list[dict[str, Any]]) -> None:
        assert self.file is not None
        job, slot = handle.job, handle.slot
        if isinstance(ended, Death):
            self.log(f"[{slot}] ✗ The worker for {job.label} died: {ended.reason}")
            if job.attempt < ATTEMPTS:
                queue.insert(0, _Retry(job.again(self._records())))
                return
            record = failed_record(job.knobs, "died", ended.reason)
            record["detail"] = ended.detail
            self.failed += 1
        else:
            for line in ended.log:
                self.log(f"[{slot}] {line}")
            record = {**job.knobs, **ended.record}
            for entry in ended.pending:
                if self.cache is not None:
                    entry.write(self.cache)
            self.failed += record.get("failure") is not None
        record["ran_on"] = {"engine": self.engine.name, "slot": slot, "attempt": job.attempt}
        if isinstance(ended, Outcome):
            record["ran_on"]["host"] = ended.host
        self.ran_on[slot] += 1
        self.file.add(record)
        self.done += 1

    def _report(self, running: int) -> None:
        if self.progress is not None:
            self.progress({"done": self.done, "running": running, "failed": self.failed})


class _Retry(dict):
    """A configuration sent again: its knobs (as the queue holds them) and the job that carries its attempt."""

    def __init__(self, job: ConfigJob):
        super().__init__(job.knobs)
        self.job = job


def _attempt(job: ConfigJob) -> str:
    return f" (attempt {job.attempt}, in a new process)" if job.attempt > 1 else ""
