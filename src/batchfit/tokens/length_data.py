"""The sequence lengths of the user's data, as a soak draws them: a histogram, a list of lengths, or a file of
lengths (one a line, or a JSON list; a JSON object reads as a histogram), drawn in random order with a seed."""

from __future__ import annotations

import json
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchfit.bounds import check_size
from batchfit.errors import InputError
from batchfit.errors import InputTypeError

FILE_FORMS = "one length a line, a JSON list of lengths, or a JSON object of length: count"


@dataclass(frozen=True)
class LengthSample:
    """Lengths and how often each occurs (``counts``), drawn with probability in proportion.

    >>> sample = LengthSample.of({128: 3, 1024: 1})
    >>> sample.draw(8, seed=0).tolist()
    [128, 128, 128, 128, 1024, 1024, 128, 128]
    >>> LengthSample.of([100, 100, 4000]).longest
    4000
    """

    lengths: tuple[int, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, data: Sequence[int] | Mapping[int, int] | str | Path) -> LengthSample:
        """From a histogram (length -> count), a list of lengths, or a path to a file of lengths."""
        if isinstance(data, (str, Path)):
            return cls.of(read_lengths(Path(data)))
        if isinstance(data, Mapping):
            pairs = {
                check_size("a sequence length", length): check_size("a length's count", count, smallest=0)
                for length, count in data.items()
            }
            if not sum(pairs.values()):
                raise InputError("the length histogram counts no sequence: give at least one length with a count")
            return cls(tuple(pairs), tuple(pairs.values()))
        if isinstance(data, (bytes, np.ndarray)) or not isinstance(data, Sequence):
            raise InputTypeError(f"lengths must be a list, a histogram (length: count) or a file, got {data!r:.60}")
        if not data:
            raise InputError("no lengths given: give the lengths of the data's sequences, such as [128, 512, 4096]")
        lengths, counts = np.unique([check_size("a sequence length", length) for length in data], return_counts=True)
        return cls(tuple(int(n) for n in lengths), tuple(int(c) for c in counts))

    @property
    def longest(self) -> int:
        return max(length for length, count in zip(self.lengths, self.counts, strict=True) if count)

    def draw(self, count: int, seed: int) -> np.ndarray:
        """``count`` lengths drawn in random order (the same ``seed``, the same lengths)."""
        weights = np.array(self.counts, dtype=np.float64)
        return np.random.default_rng(seed).choice(np.array(self.lengths), size=count, p=weights / weights.sum())


def read_lengths(path: Path) -> list[int] | dict[int, int]:
    """The lengths in ``path``: ``FILE_FORMS``; a missing, empty or unreadable file is one line naming the fix."""
    if not path.is_file():
        raise InputError(f"lengths file {path} not found: give a file of lengths ({FILE_FORMS})")
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not text:
        raise InputError(f"lengths file {path} is empty: give a file of lengths ({FILE_FORMS})")
    if text[0] in "[{":
        return _json_lengths(path, text)
    lengths = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            lengths.append(_integer(line.strip(), f"line {number} of {path}"))
    return lengths


def _json_lengths(path: Path, text: str) -> list[int] | dict[int, int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"lengths file {path} is not valid JSON ({error.msg}, line {error.lineno}): {FILE_FORMS}"
        ) from None
    if isinstance(data, dict):
        return {
            _integer(key, f"a key of {path}"): _integer(value, f"the count of {key} in {path}")
            for key, value in data.items()
        }
    return [_integer(value, f"item {number} of {path}") for number, value in enumerate(data, 1)]


def _integer(value: object, where: str) -> int:
    """``value`` as an integer (``"128"``, ``128`` or ``128.0``), else one line naming ``where``."""
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not number.is_integer():
        raise InputError(f"{where} is {value!r:.40}, not a whole number of tokens: give {FILE_FORMS}")
    return int(number)
