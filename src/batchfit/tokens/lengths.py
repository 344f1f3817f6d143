"""The sequence lengths a run will see, as buckets: each bucket's answer is measured at its longest sequence."""

from __future__ import annotations

from collections.abc import Sequence

from batchfit.errors import InputError

DEFAULT_BUCKETS = 6  # buckets made from a longest length: it, its half, its quarter, ...


def bucket_lengths(
    buckets: Sequence[int] | None = None, max_seq_len: int | None = None, count: int = DEFAULT_BUCKETS
) -> list[int]:
    """Each bucket's longest sequence, ascending: ``buckets`` as given, or ``count`` buckets made from
    ``max_seq_len`` by halving (``max_seq_len``, its half, its quarter, ..., none below 1).

    >>> bucket_lengths(max_seq_len=4096, count=4)
    [512, 1024, 2048, 4096]
    >>> bucket_lengths([1024, 256, 512])
    [256, 512, 1024]
    """
    if (buckets is None) == (max_seq_len is None):
        raise InputError(
            "give the buckets' lengths (--buckets 256,512,1024) or the longest length (--max-seq-len 4096)"
        )
    if max_seq_len is not None:
        _check_positive("max_seq_len", max_seq_len)
        _check_positive("the number of buckets", count)
        buckets = sorted({max(1, max_seq_len >> halvings) for halvings in range(count)})
    lengths = list(buckets)
    if not lengths:
        raise InputError("give at least one bucket length, such as --buckets 256,512,1024")
    for length in lengths:
        _check_positive("a bucket length", length)
    if len(set(lengths)) != len(lengths):
        raise InputError(f"bucket lengths must differ, got {lengths}: give each bucket's longest sequence once")
    return sorted(lengths)


def parse_buckets(text: str) -> list[int]:
    """``"256,512,1024"`` as ``[256, 512, 1024]``; anything else is refused in one line.

    >>> parse_buckets("256, 512,1024")
    [256, 512, 1024]
    """
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--buckets takes lengths separated by commas, such as 256,512,1024; got {text!r}") from None


def _check_positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{what} must be a positive integer, got {value!r}")
