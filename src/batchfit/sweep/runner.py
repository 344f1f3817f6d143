"""SweepRunner: one configuration after another in this process, each searched by ``ConfigSearch``;
records go to the results file as they come. Under torch.distributed every rank takes the same decisions
(resume, cache hit, starting estimate), so no rank waits alone."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchfit.devices.resolve import resolve_device
from batchfit.search import distributed
from batchfit.search.cached import CacheSpec
from batchfit.search.cached import open_cache
from batchfit.search.runner import DeviceSpec
from batchfit.step.factory import check_options
from batchfit.step.workload import Workload
from batchfit.sweep.config_search import ConfigSearch
from batchfit.sweep.config_search import Measure
from batchfit.sweep.config_search import SweepSettings
from batchfit.sweep.config_search import build_workload
from batchfit.sweep.results import SweepFile
from batchfit.sweep.results import SweepResult
from batchfit.sweep.results import describe
from batchfit.sweep.results import device_fields


class SweepRunner:
    def __init__(
        self,
        factory: Callable[..., Workload],
        device: DeviceSpec,
        settings: SweepSettings,
        cache: CacheSpec,
        measure: Measure | None,
    ):
        self.factory, self.device, self.settings = factory, device, settings
        self.file: SweepFile | None = None
        self.configs: ConfigSearch | None = None
        self.cache = open_cache(cache)
        self.measure = measure
        self.agreeing = distributed.active()
        self.primary = not self.agreeing or distributed.rank() == 0  # writes the results file

    def run(self, configs: list[dict[str, Any]], path: str | Path | None, name: str) -> SweepResult:
        check_options(name, self.factory, configs[0])
        first = self._build(configs[0])
        dev = resolve_device(self.device, first.model)
        header = {
            "workload": name,
            "knobs": list(configs[0]),
            "device": device_fields(dev),
            "settings": {"mode": first.mode, **self.settings.header()},
        }
        self.file = SweepFile(path, header, primary=self.primary)
        self.configs = ConfigSearch(self.device, self.settings, self.cache, self.measure, knob_names=list(configs[0]))
        workload: Workload | None = first
        del first
        for knobs in configs:
            if self._resumed(knobs, path) is None:
                self.file.add(self._one(knobs, workload or self._build(knobs)))
            # A configuration's model must not hold memory during the next one's search (as on a GPU).
            workload = None
            gc.collect()
            dev.cleanup()
        records = [self.file.done(knobs) for knobs in configs]
        return SweepResult(records, list(configs[0]), dev.name, self.file.path)

    def _resumed(self, knobs: dict[str, Any], path: str | Path | None) -> dict[str, Any] | None:
        """The configuration's record from the results file, if every rank has it."""
        assert self.file is not None
        done = self.file.done(knobs)
        if self.agreeing and distributed.any_rank(done is None):
            return None  # a rank without the record measures it, so all do
        if done is not None:
            self.settings.log(
                f"Already measured {describe(knobs)}: batch size {done['batch_size_used']} (resumed from {path})"
            )
        return done

    def _build(self, knobs: dict[str, Any]) -> Workload:
        return build_workload(self.factory, knobs)

    def _one(self, knobs: dict[str, Any], workload: Workload) -> dict[str, Any]:
        assert self.file is not None and self.configs is not None
        return self.configs.run(knobs, workload, list(self.file.records.values()))
