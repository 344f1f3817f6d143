"""A sweep's configuration as a job any process can run: picklable inputs in (``ConfigJob``), the record a
sequential sweep writes out (``Outcome``), whatever engine runs it (``batchfit.sweep.engines``).

``run_job`` is the one function every engine runs, in a fresh process per configuration: it builds the
workload from the factory, searches it as the sequential sweep does (``ConfigSearch``: the cache read, the
estimate from the records measured so far, the trials), and returns the record, the cache entry for the
driver to write and the log lines. A factory or a step that raises is recorded with its error, and the sweep
goes on; only a process that dies gives no outcome (the engine reports it as a ``Death``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchfit.errors import InputError
from batchfit.search.cache import ResultCache
from batchfit.search.settings import SearchSettings
from batchfit.step.workload import Workload
from batchfit.sweep.config_search import ConfigSearch
from batchfit.sweep.config_search import PendingStore
from batchfit.sweep.config_search import SweepSettings
from batchfit.sweep.config_search import build_workload
from batchfit.sweep.results import describe
from batchfit.sweep.rules import ScaleRules

RETRIED_FAILURES = ("raised", "died")  # records of these kinds are measured again when the sweep is run again


@dataclass(frozen=True)
class MainFunction:
    """A function of the script run as ``__main__``, by its file and name: a fresh process imports the
    file as a module (so its ``if __name__ == "__main__":`` part does not run again) and calls it."""

    path: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(_script(self.path), self.name)(*args, **kwargs)


@functools.cache
def _script(path: str) -> Any:
    """The script at ``path`` imported as a module, once per process (the factory and ``measure`` share it)."""
    spec = importlib.util.spec_from_file_location("batchfit_sweep_main", path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot import {path} in the sweep's worker: give the factory as module:function")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def portable(function: Callable[..., Any] | None, what: str) -> Callable[..., Any] | None:
    """``function`` as another process can import it: itself when it pickles by reference, a ``MainFunction``
    when it lives in the script run as ``__main__``; a lambda or closure is an ``InputError`` naming the fix."""
    if function is None:
        return None
    main = sys.modules.get("__main__")
    if getattr(function, "__module__", None) == "__main__" and getattr(main, "__file__", None):
        name = getattr(function, "__qualname__", "")
        if name.isidentifier() and getattr(main, name, None) is function:
            return MainFunction(str(Path(main.__file__).resolve()), name)
    try:
        pickle.dumps(function)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise InputError(
            f"the {what} cannot be sent to another process ({error}): define it at the top level of a module "
            "(not a lambda or a nested function), or give the workload as module:function"
        ) from None
    return function


@dataclass(frozen=True)
class JobSettings:
    """The sweep's settings a job needs (``SweepSettings`` without its log, which stays with the driver)."""

    search: SearchSettings
    auto_adjust: bool
    estimate: tuple[str, ...]
    rules: ScaleRules | None

    def for_worker(self, log: Callable[[str], None]) -> SweepSettings:
        return SweepSettings(self.search, self.auto_adjust, self.estimate, self.rules, log)


@dataclass(frozen=True)
class ConfigJob:
    """One configuration to search, with everything the process that runs it needs.

    ``records`` are the configurations measured when it was sent (the memory model fitted across them gives
    its start); ``cache_dir`` is read, never written (``None``: no cache; ``""``: the default folder).
    """

    knobs: Mapping[str, Any]
    factory: Callable[..., Workload]
    device: str
    settings: JobSettings
    knob_names: tuple[str, ...]
    records: tuple[Mapping[str, Any], ...] = ()
    cache_dir: str | None = None
    measure: Callable[..., Any] | None = None
    attempt: int = 1

    @property
    def label(self) -> str:
        return describe(self.knobs)

    def again(self, records: tuple[Mapping[str, Any], ...]) -> ConfigJob:
        """The same configuration as a new attempt, with the records measured since."""
        return replace(self, records=records, attempt=self.attempt + 1)


@dataclass
class Outcome:
    """What a job gives back: its record, the cache entries for the driver to write, its log lines and where
    it ran (``host``, ``pid``)."""

    knobs: dict[str, Any]
    record: dict[str, Any]
    pending: list[PendingStore] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Death:
    """A job whose process ended without an outcome (killed, crashed, lost with its node): never an
    out-of-memory bound. ``reason`` is one line; ``detail`` the end of what the process printed."""

    reason: str
    detail: str = ""


def run_job(job: ConfigJob) -> Outcome:
    """Search one configuration as the sequential sweep does and return its record (see the module's doc)."""
    lines: list[str] = []
    knobs = dict(job.knobs)
    outcome = Outcome(knobs, {}, log=lines, host=socket.gethostname(), pid=os.getpid())
    started = time.perf_counter()
    try:
        workload = build_workload(job.factory, knobs)
        cache = None if job.cache_dir is None else ResultCache(job.cache_dir or None, read_only=True)
        search = ConfigSearch(
            job.device,
            job.settings.for_worker(lines.append),
            cache,
            job.measure,
            knob_names=list(job.knob_names),
            defer_store=True,
        )
        outcome.record = search.run(knobs, workload, [dict(r) for r in job.records])
        outcome.pending = search.pending
    except Exception as error:  # the configuration's own error: recorded, and the sweep goes on
        lines.append(f"✗ {job.label} raised {type(error).__name__}: {error}")
        outcome.record = failed_record(
            knobs, "raised", f"{type(error).__name__}: {error}", time.perf_counter() - started
        )
        outcome.record["traceback"] = traceback.format_exc(limit=-8)
    return outcome


def failed_record(knobs: Mapping[str, Any], failure: str, error: str, seconds: float = 0.0) -> dict[str, Any]:
    """The record of a configuration that gave no answer: it ``raised`` or its process ``died``; a later
    run of the same sweep measures it again (``RETRIED_FAILURES``)."""
    return {
        **knobs,
        "batch_size_used": None,
        "fits": False,
        "failure": failure,
        "error": error,
        "trials": [],
        "seconds": seconds,
    }
