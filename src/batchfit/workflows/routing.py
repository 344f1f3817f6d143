"""Which path a workload takes, decided once for ``find``, ``estimate`` and ``plan``.

A workload is named as a built-in, ``module:function`` or ``path/to/file.py:function`` (a workload of the
user's own), or as an LLM preset or a Hugging Face ``config.json`` (a model built from its config). Three
routes follow:

- ``OWN``: the workload as it is, on one device;
- ``OWN_RANK``: one rank of the workload's own model copied and sharded with FSDP2 (a parallelism was asked
  for): real trials, or traces on a trace device;
- ``CONFIG``: one rank of a model built from its config, always sharded (one rank when no world is given).
"""

from __future__ import annotations

from enum import Enum

DEFAULT_SEQ_LEN = 4096  # a model from its config trains on token ids: this many per sample unless asked otherwise


class Route(str, Enum):
    """The path a workload takes (see the module)."""

    OWN = "own"
    OWN_RANK = "own_rank"
    CONFIG = "config"


def from_config(workload: str) -> bool:
    """Whether ``workload`` names a model built from its config: an LLM preset or a config.json.

    >>> from_config("llama-3-8b"), from_config("my/config.json"), from_config("train.py:make")
    (True, True, False)
    """
    from batchfit.parallel.models import LLM_PRESETS

    return workload in LLM_PRESETS or workload.endswith(".json")


def route_workload(workload: str, sharded: bool) -> Route:
    """The route of ``workload``, ``sharded`` when a parallelism was asked for (ranks, FSDP2, CPU offload).

    >>> route_workload("gpt-tiny", False).value, route_workload("gpt-tiny", True).value
    ('own', 'own_rank')
    >>> route_workload("llama-3-8b", False).value
    'config'
    """
    if from_config(workload):
        return Route.CONFIG
    return Route.OWN_RANK if sharded else Route.OWN
