"""The checks every public workflow makes of its arguments, once, before any work: a one-line ``InputError`` or
``InputTypeError`` naming the argument and the fix, as the library's older entry points give, never a raw
Python error from deep inside or a silent misreading (``verify="no"`` taken as true)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchfit.bounds import check_flag
from batchfit.bounds import check_size
from batchfit.errors import InputError
from batchfit.errors import InputTypeError
from batchfit.parallel.settings import Parallelism
from batchfit.search.settings import SearchSettings
from batchfit.workflows.progress import Progress


def check_model_spec(workload: Any) -> None:
    """A model built from its config is named by an LLM preset or a config.json path (text)."""
    if not isinstance(workload, str) or not workload.strip():
        raise InputTypeError(
            f"workload must be an LLM preset name or a config.json path (text), got {workload!r}: e.g. 'llama-3-8b'"
        )


def check_capacity_spec(capacity: Any) -> None:
    """A capacity is a GPU preset name or a size in text (``"80GiB"``)."""
    if not isinstance(capacity, str) or not capacity.strip():
        raise InputTypeError(
            f"capacity must be a GPU preset or a size such as 'h100-80gb' or '80GiB', got {capacity!r}"
        )


def check_choices(choices: Any) -> list[Parallelism]:
    """One or more ``Parallelism`` settings of one world (the activation-checkpointing choices compared)."""
    if isinstance(choices, Parallelism):
        raise InputTypeError("choices must be a list of Parallelism settings: wrap the one you have in [ ]")
    if not isinstance(choices, Sequence) or not choices:
        raise InputError(f"choices must be a non-empty list of Parallelism settings, got {choices!r}")
    for choice in choices:
        check_parallelism(choice, "each of choices")
    worlds = {(choice.world_size, choice.gpus_per_node) for choice in choices}
    if len(worlds) > 1:
        raise InputError(f"choices must share one world (ranks, ranks per node), got {sorted(worlds)}")
    return list(choices)


def check_parallelism(parallelism: Any, name: str = "parallelism") -> Parallelism:
    if not isinstance(parallelism, Parallelism):
        raise InputTypeError(
            f"{name} must be a batchfit Parallelism, got {type(parallelism).__name__}: e.g. Parallelism(world_size=8)"
        )
    return parallelism


def check_callable(name: str, value: Any, example: str) -> None:
    if not callable(value):
        raise InputTypeError(f"{name} must be a function, got {value!r}: {example}")


def check_progress(progress: Any) -> None:
    if not isinstance(progress, Progress):
        raise InputTypeError(
            f"progress must be a batchfit Progress (batchfit.workflows.progress), got {type(progress).__name__}"
        )


def check_settings(settings: Any) -> None:
    if settings is not None and not isinstance(settings, SearchSettings):
        raise InputTypeError(f"settings must be a batchfit SearchSettings or None, got {type(settings).__name__}")


def check_lengths(lengths: Any) -> list[int]:
    """Bucket lengths: a non-empty list of sizes (``batchfit.bounds``), each checked."""
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise InputTypeError(f"lengths must be a list of bucket lengths such as [256, 512, 1024], got {lengths!r}")
    if not lengths:
        raise InputError("lengths must hold at least one bucket length, such as [256, 512, 1024]")
    return [check_size("a bucket length", length) for length in lengths]


__all__ = [
    "check_callable",
    "check_capacity_spec",
    "check_choices",
    "check_flag",
    "check_lengths",
    "check_model_spec",
    "check_parallelism",
    "check_progress",
    "check_settings",
    "check_size",
]
