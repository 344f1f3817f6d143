"""The sequence lengths a run will see, as buckets: each bucket's answer is measured at its longest sequence."""

from __future__ import annotations

from collections.abc import Sequence

from batchfit.bounds import check_size
from batchfit.errors import InputError
from batchfit.errors import InputTypeError

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
        check_size("max_seq_len", max_seq_len)
        check_size("the number of buckets", count)
        halvings = min(count, max_seq_len.bit_length())  # past that, every bucket would be 1 token long
        buckets = sorted({max(1, max_seq_len >> halving) for halving in range(halvings)})
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence):
        raise InputTypeError(f"lengths must be a list of bucket lengths such as [256, 512, 1024], got {buckets!r}")
    lengths = list(buckets)
    if not lengths:
        raise InputError("give at least one bucket length, such as --buckets 256,512,1024")
    for length in lengths:
        check_size("a bucket length", length)
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
