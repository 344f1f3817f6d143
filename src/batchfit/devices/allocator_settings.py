"""The CUDA caching allocator's settings: what ``PYTORCH_CUDA_ALLOC_CONF`` sets, parsed as torch parses it, and
read from the running process.

The grammar and limits follow torch's ``c10/core/AllocatorConfig.cpp`` (``AcceleratorAllocatorConfig::parseArgs``,
torch 2.13): ``key:value`` pairs separated by commas, whitespace ignored; ``max_split_size_mb:N`` (N >= 20);
``roundup_power2_divisions:D`` (a power of 2, every size) or ``[B:D,...,>:D]`` (per power-of-2 interval of sizes
in MiB); ``garbage_collection_threshold:F`` (0 < F < 1); ``expandable_segments:True|False``. Keys of the CUDA
backend that do not change where blocks go (``pinned_*``, ``release_lock_on_cudamalloc``, ...) are accepted and
ignored. ``per_process_memory_fraction:F`` caps what the process may reserve.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass

from batchfit.errors import InputError

MIB = 2**20
LARGE_SEGMENT_BYTES = 20 * MIB  # kLargeBuffer: the default large_segment_size
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: [0, 2 MiB), [2, 4), [4, 8), ... MiB, the last open-ended
ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the first set is read
IGNORED_KEYS = (  # accepted by torch, no effect on where a block goes
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
    "graph_capture_record_stream_reuse",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)


@dataclass(frozen=True)
class AllocatorSettings:
    """How the caching allocator places blocks (defaults: torch's).

    >>> AllocatorSettings.parse("expandable_segments:True,max_split_size_mb:128").to_conf()
    'max_split_size_mb:128,expandable_segments:True'
    >>> AllocatorSettings.parse("roundup_power2_divisions:4").roundup_divisions[0]
    4
    """

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: unlimited (SIZE_MAX), every block may be split
    max_non_split_rounding_bytes: int = LARGE_SEGMENT_BYTES
    roundup_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS  # per interval; 0 or 1: no power-of-2 rounding
    garbage_collection_threshold: float = 0.0
    per_process_memory_fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> AllocatorSettings:
        """Settings from a ``PYTORCH_CUDA_ALLOC_CONF`` string; a malformed one is an ``InputError`` naming the key."""
        values: dict[str, object] = {}
        for key, value in _pairs(text):
            _apply(values, key, value)
        return cls(**values)

    @classmethod
    def from_process(cls) -> AllocatorSettings:
        """The settings this process's allocator runs with: the last string given to torch
        (``torch._C._accelerator_getAllocatorSettings``, which also holds the environment's), else the
        environment (``PYTORCH_CUDA_ALLOC_CONF``, then ``PYTORCH_HIP_ALLOC_CONF``, then ``PYTORCH_ALLOC_CONF``)."""
        return cls.parse(process_conf())

    def with_expandable_segments(self, on: bool = True) -> AllocatorSettings:
        return dataclasses.replace(self, expandable_segments=on)

    def to_conf(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` string of these settings (empty for torch's defaults)."""
        parts = []
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MIB}")
        if self.max_non_split_rounding_bytes != LARGE_SEGMENT_BYTES:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_bytes // MIB}")
        if any(self.roundup_divisions):
            entries = ",".join(f"{2**i if i else 1}:{d}" for i, d in enumerate(self.roundup_divisions))
            parts.append(f"roundup_power2_divisions:[{entries}]")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.per_process_memory_fraction is not None:
            parts.append(f"per_process_memory_fraction:{self.per_process_memory_fraction}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        return ",".join(parts)


def process_conf() -> str:
    """The allocator string of this process, as torch last parsed it (see ``AllocatorSettings.from_process``)."""
    import torch

    read = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    text = read() if callable(read) else ""
    if text:
        return text
    return next((os.environ[name] for name in ENVIRONMENT if os.environ.get(name)), "")


def _pairs(text: str) -> list[tuple[str, str]]:
    """``"a:1,b:[2:3,>:4]"`` -> ``[("a", "1"), ("b", "[2:3,>:4]")]``, whitespace dropped as torch's tokenizer does."""
    compact = re.sub(r"\s+", "", text)
    pairs, depth, start = [], 0, 0
    for index, char in enumerate(compact + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            item = compact[start:index]
            start = index + 1
            if not item:
                continue
            key, sep, value = item.partition(":")
            if not sep or not value:
                raise InputError(f"allocator setting {item!r} must be key:value (e.g. expandable_segments:True)")
            pairs.append((key, value))
    return pairs


def _apply(values: dict[str, object], key: str, value: str) -> None:
    if key == "expandable_segments":
        values[key] = _bool(key, value)
    elif key == "max_split_size_mb":
        values["max_split_size_bytes"] = _megabytes(key, value, LARGE_SEGMENT_BYTES // MIB)
    elif key == "max_non_split_rounding_mb":
        values["max_non_split_rounding_bytes"] = _megabytes(key, value, LARGE_SEGMENT_BYTES // MIB)
    elif key == "roundup_power2_divisions":
        values["roundup_divisions"] = _divisions(value)
    elif key == "garbage_collection_threshold":
        values["garbage_collection_threshold"] = _fraction(key, value, open_interval=True)
    elif key == "per_process_memory_fraction":
        values["per_process_memory_fraction"] = _fraction(key, value, open_interval=False)
    elif key not in IGNORED_KEYS:
        raise InputError(
            f"unknown allocator setting {key!r}: torch reads expandable_segments, max_split_size_mb, "
            "roundup_power2_divisions, garbage_collection_threshold and per_process_memory_fraction"
        )


def _bool(key: str, value: str) -> bool:
    if value not in ("True", "False"):
        raise InputError(f"{key} must be True or False (as torch spells them), got {value!r}")
    return value == "True"


def _megabytes(key: str, value: str, least: int) -> int:
    if not value.isdigit() or int(value) < least:
        raise InputError(f"{key} must be a whole number of MiB, at least {least}, got {value!r}")
    return int(value) * MIB


def _fraction(key: str, value: str, *, open_interval: bool) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    low_ok = number > 0 if open_interval else number >= 0
    high_ok = number < 1 if open_interval else number <= 1
    if not (low_ok and high_ok):
        interval = "(0, 1)" if open_interval else "[0, 1]"
        raise InputError(f"{key} must be a number in {interval}, got {value!r}")
    return number


def _power_of_two(text: str, what: str, zero_ok: bool) -> int:
    number = int(text) if text.isdigit() else -1
    if not (number == 0 and zero_ok) and (number < 1 or number & (number - 1)):
        raise InputError(f"roundup_power2_divisions: {what} must be a power of 2, got {text!r}")
    return number


def _divisions(value: str) -> tuple[int, ...]:
    """One power of 2 for every interval, or ``[B:D,...,>:D]``: interval ``log2(B)`` (B in MiB) gets D, the first
    entry also every lower interval, ``>`` every interval after the last one named (torch's ``parseRoundUpPower2Divisions``)."""
    if not value.startswith("["):
        return (_power_of_two(value, "divisions", zero_ok=False),) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise InputError(f"roundup_power2_divisions list must end with ']', got {value!r}")
    slots = [0] * ROUNDUP_INTERVALS
    last = None
    for entry in filter(None, value[1:-1].split(",")):
        bound, _, divisions = entry.partition(":")
        count = _power_of_two(divisions, "divisions", zero_ok=True)
        if bound == ">":
            start = 0 if last is None else last + 1
            slots[start:] = [count] * (ROUNDUP_INTERVALS - start)
            continue
        index = min(int(math.log2(_power_of_two(bound, "a size in MiB", zero_ok=False))), ROUNDUP_INTERVALS - 1)
        if last is None:
            slots[:index] = [count] * index
        slots[index] = count
        last = index
    return tuple(slots)


ALLOCATOR_KINDS = ("exact", "cuda", "cuda-expandable")
ALLOCATOR_HELP = (
    "'exact' (every live byte counted against the capacity), 'cuda' (the CUDA caching allocator, with this "
    "process's PYTORCH_CUDA_ALLOC_CONF), 'cuda-expandable' (the same with expandable_segments:True) or an "
    "AllocatorSettings"
)


def resolve_allocator(spec: str | AllocatorSettings | None) -> AllocatorSettings | None:
    """The settings of the allocator a simulated device models, ``None`` for exact counting.

    >>> resolve_allocator("exact") is None, resolve_allocator(AllocatorSettings()) == AllocatorSettings()
    (True, True)
    """
    if spec is None or isinstance(spec, AllocatorSettings):
        return spec
    if not isinstance(spec, str):
        raise InputError(f"allocator must be {ALLOCATOR_HELP}, got {type(spec).__name__}")
    kind = spec.strip().lower()
    if kind == "exact":
        return None
    if kind == "cuda":
        return AllocatorSettings.from_process()
    if kind == "cuda-expandable":
        return AllocatorSettings.from_process().with_expandable_segments()
    raise InputError(f"unknown allocator {spec!r}: use {ALLOCATOR_HELP}")


def allocator_label(settings: AllocatorSettings | None) -> str:
    """A short name for device names and reports: ``exact``, ``cuda``, ``cuda-expandable`` or ``cuda(SETTINGS)``.

    >>> allocator_label(None), allocator_label(AllocatorSettings(expandable_segments=True))
    ('exact', 'cuda-expandable')
    """
    if settings is None:
        return "exact"
    if settings == AllocatorSettings():
        return "cuda"
    if settings == AllocatorSettings(expandable_segments=True):
        return "cuda-expandable"
    return f"cuda({settings.to_conf()})"
