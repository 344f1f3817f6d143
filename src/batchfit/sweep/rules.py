"""Scale-factor rules (a profiling sweep's tables): a starting batch from a base size and each knob's value.

A rules file (JSON, or TOML on Python 3.11+) names a base batch and, per knob, either steps
(``upto`` a value, that ``scale``; a last step without ``upto`` covers the rest) or a ratio
(``ratio_of``: the knob divided by a total, as profiling sweeps do for active blocks)::

    {"base_batch_size": 64,
     "knobs": {"max_crops": [{"upto": 2, "scale": 1.0}, {"upto": 4, "scale": 0.8}, {"scale": 0.25}],
               "num_active_blocks": {"ratio_of": 24}}}

The estimate is ``int(base * product of the scales)``, never above the base.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit.errors import InputError

FIX = "see the rules format in `batchfit sweep --help`"


@dataclass(frozen=True)
class ScaleRules:
    """Steps or a ratio per knob, and the base batch they scale.

    >>> rules = ScaleRules.from_dict({"base_batch_size": 64,
    ...     "knobs": {"max_crops": [{"upto": 2, "scale": 1.0}, {"upto": 12, "scale": 0.3}, {"scale": 0.25}]}})
    >>> rules.estimate({"max_crops": 12}), rules.estimate({"max_crops": 13}), rules.estimate({"top_k": 4})
    (19, 16, 64)
    """

    knobs: Mapping[str, Any]
    base_batch_size: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScaleRules:
        if not isinstance(data, Mapping) or not isinstance(data.get("knobs"), Mapping):
            raise InputError(f"scale rules need a 'knobs' table: {FIX}")
        base = data.get("base_batch_size")
        if base is not None and (not isinstance(base, int) or base < 1):
            raise InputError(f"base_batch_size must be a positive integer, got {base!r}")
        for name, rule in data["knobs"].items():
            _check_rule(name, rule)
        return cls(dict(data["knobs"]), base)

    @classmethod
    def load(cls, path: str | Path) -> ScaleRules:
        """Read a ``.json`` or ``.toml`` rules file."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"rules file {path} does not exist: give a .json or .toml file ({FIX})")
        text = path.read_text()
        try:
            return cls.from_dict(_parse(path, text))
        except (json.JSONDecodeError, _toml_error()) as error:
            raise InputError(f"rules file {path} is not valid {path.suffix[1:].upper()}: {error}") from None

    def scale(self, knobs: Mapping[str, Any]) -> float:
        """The product of the scale of every knob that has a rule."""
        factor = 1.0
        for name, rule in self.knobs.items():
            if name in knobs:
                factor *= _scale(name, rule, knobs[name])
        return factor

    def estimate(self, knobs: Mapping[str, Any], base_batch_size: int | None = None) -> int | None:
        """``int(base * scale)``, at most the base and at least 1; ``None`` without a base."""
        base = self.base_batch_size or base_batch_size
        if base is None:
            return None
        return max(1, min(int(base * self.scale(knobs)), base))


def _parse(path: Path, text: str) -> Any:
    if path.suffix == ".toml":
        if sys.version_info < (3, 11):
            raise InputError("TOML rules need Python 3.11 or later: write the rules as JSON")
        import tomllib

        return tomllib.loads(text)
    return json.loads(text)


def _toml_error() -> type[Exception]:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.TOMLDecodeError
    return json.JSONDecodeError


def _check_rule(name: str, rule: Any) -> None:
    if isinstance(rule, Mapping):
        total = rule.get("ratio_of")
        if not isinstance(total, (int, float)) or total <= 0:
            raise InputError(f"rule for {name} must give a positive ratio_of (e.g. {{'ratio_of': 24}}), got {rule!r}")
        return
    if not isinstance(rule, list) or not rule:
        raise InputError(f"rule for {name} must be a list of steps or a ratio_of table, got {rule!r} ({FIX})")
    for step in rule:
        scale = step.get("scale") if isinstance(step, Mapping) else None
        if not isinstance(scale, (int, float)) or not 0 < scale <= 1 or not math.isfinite(scale):
            raise InputError(f"each step for {name} needs a scale in (0, 1], got {step!r}")


def _scale(name: str, rule: Any, value: Any) -> float:
    if isinstance(rule, Mapping):
        return min(1.0, value / rule["ratio_of"])
    for step in rule:
        if "upto" not in step or value <= step["upto"]:
            return float(step["scale"])
    raise InputError(f"{name}={value} is above every step of its rule: end the rule with a step without 'upto'")
