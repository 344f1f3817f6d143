"""FanOut: a sweep set up for an engine: the factory and ``measure`` made importable by other processes, the
results file opened (and checked) before any engine starts, the jobs' shape, then ``ParallelSweep`` drives."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.devices.resolve import from_string
from batchfit.search.cached import CacheSpec
from batchfit.search.cached import open_cache
from batchfit.step.factory import check_options
from batchfit.step.workload import Workload
from batchfit.sweep.config_search import Measure
from batchfit.sweep.config_search import SweepSettings
from batchfit.sweep.engines.options import EngineOptions
from batchfit.sweep.engines.registry import make_engine
from batchfit.sweep.jobs import ConfigJob
from batchfit.sweep.jobs import JobSettings
from batchfit.sweep.jobs import portable
from batchfit.sweep.parallel import ParallelSweep
from batchfit.sweep.results import SweepFile
from batchfit.sweep.results import SweepResult
from batchfit.sweep.results import device_fields


def describe_device(device: str) -> dict[str, Any]:
    """The device as the results file names it, without touching an accelerator: a simulated device or the
    CPU resolved here; a GPU by its name as given (each record's ``ran_on`` says where it ran).

    >>> describe_device("sim:1MiB")
    {'name': 'sim:1.0MiB', 'capacity_bytes': 1048576, 'simulated': True}
    >>> describe_device("cuda")["capacity_bytes"] is None
    True
    """
    if device.startswith("sim:") or device == "cpu":
        return device_fields(from_string(device))
    return {"name": device, "capacity_bytes": None, "simulated": False}


class FanOut:
    """A sweep run on an engine (``run``): ``factory(**knobs)`` builds each configuration in its worker."""

    def __init__(
        self,
        factory: Callable[..., Workload],
        device: str,
        settings: SweepSettings,
        cache: CacheSpec,
        measure: Measure | None,
        progress: Callable[[Mapping[str, int]], None] | None,
    ):
        self.factory, self.device, self.settings = factory, device, settings
        self.cache = open_cache(cache)
        self.measure, self.progress = measure, progress

    def run(
        self, engine: str, options: EngineOptions, configs: list[dict[str, Any]], path: str | Path | None, name: str
    ) -> SweepResult:
        _check_knobs(name, self.factory, configs[0])
        factory, measure = portable(self.factory, "factory"), portable(self.measure, "measure function")
        file = SweepFile(path, self._header(name, list(configs[0])))  # a file from another sweep fails here
        s = self.settings
        job_settings = JobSettings(s.search, s.auto_adjust, s.estimate, s.rules)
        cache_dir = None if self.cache is None else str(self.cache.directory)
        names = tuple(configs[0])

        def make_job(knobs: dict[str, Any], records: tuple[dict[str, Any], ...]) -> ConfigJob:
            return ConfigJob(knobs, factory, self.device, job_settings, names, records, cache_dir, measure)

        runner = ParallelSweep(make_engine(engine, options, self.device), make_job, self.cache, s.log, self.progress)
        return runner.run(configs, file)

    def _header(self, name: str, knobs: list[str]) -> dict[str, Any]:
        device = describe_device(self.device)
        return {"workload": name, "knobs": knobs, "device": device, "settings": self.settings.header()}


def _check_knobs(name: str, factory: Callable[..., Any], knobs: dict[str, Any]) -> None:
    """A knob the factory does not take fails before any job: by the factory's own ``check_knobs`` where it has
    one (the command line's workload by name), else by its signature where that can be read."""
    check = getattr(factory, "check_knobs", None)
    if callable(check):
        check(knobs)
        return
    try:
        inspect.signature(factory)
    except (TypeError, ValueError):
        return
    check_options(name, factory, knobs)
