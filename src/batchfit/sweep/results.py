"""The sweep's results file (``{"summary": [records], ...settings}``), rewritten atomically after every configuration.

``{"summary": [{"<knob>": value, ..., "batch_size_used": 63, "trials": [...], ...}], "device": ...,
"settings": ..., "versions": ...}``. A crash loses at most the configuration that was running; a
re-run with the same file keeps every record and measures only what is missing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit._version import versions
from batchfit.errors import InputError
from batchfit.files import atomic_write_text

MOVE_IT = "move it away or choose another results path"


def config_key(knobs: Mapping[str, Any]) -> str:
    """A configuration's identity: its knob values in a canonical form."""
    return json.dumps(dict(knobs), sort_keys=True, default=repr)


class SweepFile:
    """The records of one sweep, by configuration, and where they are written (``path`` may be
    ``None``: nothing is written). ``header["knobs"]`` names the knobs; each record holds their
    values at its top level. Across ranks only the ``primary`` one writes, and
    the others read the records without checking the header (their device names differ)."""

    def __init__(self, path: str | Path | None, header: dict[str, Any], *, primary: bool = True):
        self.path = Path(path) if path is not None else None
        self.header = header
        self.primary = primary
        self.knob_names: list[str] = list(header["knobs"])
        self.records: dict[str, dict[str, Any]] = {}
        if self.path is not None and self.path.exists():
            self._resume()

    def _resume(self) -> None:
        assert self.path is not None
        if self.path.is_dir():
            raise InputError(f"results path {self.path} is a folder: give a file name such as sweep.json")
        try:
            document = json.loads(self.path.read_text())
            records = document["summary"]
        except (ValueError, KeyError, TypeError) as error:
            raise InputError(f"{self.path} is not a batchfit sweep results file ({error}): {MOVE_IT}") from None
        for field in ("knobs", "device", "settings"):
            if self.primary and document.get(field) != self.header.get(field):
                raise InputError(
                    f"{self.path} was written with another {field} ({document.get(field)!r}, now "
                    f"{self.header.get(field)!r}): {MOVE_IT}, or run with the same {field}"
                )
        for record in records:
            self.records[self._key(record)] = record

    def _key(self, record: Mapping[str, Any]) -> str:
        return config_key({name: record.get(name) for name in self.knob_names})

    def done(self, knobs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The record of a configuration already measured, or ``None``."""
        return self.records.get(self._key(knobs))

    def add(self, record: dict[str, Any]) -> None:
        """Keep ``record`` (replacing one for the same knobs) and rewrite the file."""
        self.records[self._key(record)] = record
        if self.path is not None and self.primary:
            document = {"summary": list(self.records.values()), **self.header, "versions": versions()}
            atomic_write_text(self.path, json.dumps(document, indent=2, default=repr) + "\n")


def device_fields(device: Any) -> dict[str, Any]:
    """A device as the results file names it (its ``device`` entry)."""
    return {"name": device.name, "capacity_bytes": device.capacity_bytes(), "simulated": device.simulated}


def describe(knobs: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in knobs.items())


@dataclass
class SweepResult:
    """Every configuration's record (the file's ``summary``), in grid order."""

    records: list[dict[str, Any]]
    knobs: list[str]
    device: str
    path: Path | None
    ran_on: dict[str, Any] | None = None
    """Where an engine ran the configurations: ``{"engine": "local", "slots": {"cuda:0": 6, ...}}``
    (``None``: one after another in this process)."""

    @property
    def total_trials(self) -> int:
        """Trials run by this sweep and the runs it resumed (a cache hit counts none)."""
        return sum(len(record["trials"]) for record in self.records)

    def batch_size(self, **knobs: Any) -> int | None:
        """The batch size used for one configuration."""
        for record in self.records:
            if all(record.get(k) == v for k, v in knobs.items()):
                return record["batch_size_used"]
        raise KeyError(f"no configuration {describe(knobs)} in this sweep")

    def summary(self, seconds: float | None = None) -> str:
        """One sentence: configurations, trials (and how many answers came from the cache), what did not fit.

        >>> SweepResult([{"seq_len": 8, "trials": [1, 2], "fits": True}, {"seq_len": 16, "trials": [3], "fits": False}],
        ...             ["seq_len"], "sim:1MiB", None).summary(seconds=0.25)
        '2 configurations, 3 trials (0 from the result cache), 0.2 s. Nothing fitted for: seq_len=16.'
        """
        cached = sum(1 for record in self.records if record.get("cached"))
        failed = [describe({k: r[k] for k in self.knobs}) for r in self.records if not r.get("fits", True)]
        broken = [describe({k: r[k] for k in self.knobs}) for r in self.records if r.get("failure")]
        failed = [label for label in failed if label not in broken]
        took = f", {seconds:.1f} s" if seconds is not None else ""
        line = f"{len(self.records)} configurations, {self.total_trials} trials ({cached} from the result cache){took}."
        if self.ran_on is not None:
            slots = ", ".join(f"{slot} ({count})" for slot, count in self.ran_on["slots"].items())
            line += f" Ran on the {self.ran_on['engine']} engine: {slots}."
        line += f" Nothing fitted for: {'; '.join(failed)}." if failed else ""
        return line + (f" No answer (raised or died; run again to retry): {'; '.join(broken)}." if broken else "")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every record (under ``summary``, the results file's key), the knobs and the device."""
        return {"summary": self.records, "knobs": self.knobs, "device": self.device, "ran_on": self.ran_on}
