"""How a micro-batch's peak grows with its rows and their length: fixed + per token + per squared length.

A padded micro-batch of ``B`` sequences of ``L`` tokens peaks at about

    peak(B, L) = fixed + B * (per_token * L + per_squared * L**2)

``fixed`` is what no row changes (parameters, gradients, optimizer state, workspaces); each row holds
activations that grow with its tokens, and, where the attention kernel keeps the score matrix (eager or
math attention), with the square of its length. Where the kernel keeps no score matrix (flash, memory-
efficient, a varlen kernel over packed sequences), ``per_squared`` comes out zero. The fit is made from
the trials a search already ran: at each length measured, the line of the search's own memory model
(``MemoryModel``) that decides the edge gives ``fixed`` and the bytes per row; across lengths, bytes per
row = per_token * L + per_squared * L**2, by least squares, ``per_squared`` held at zero where the data
would make it negative.

It predicts the largest size at a length not yet searched, the next search's first guess. The
guess is only a guess: every answer is still found and confirmed by trials.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from batchfit.search.memory_model import MemoryModel
from batchfit.search.trial import Trial


@dataclass(frozen=True)
class LengthLine:
    """At one sequence length: ``peak = fixed_bytes + bytes_per_row * rows``, from two trials that fitted."""

    seq_len: int
    fixed_bytes: float
    bytes_per_row: float

    @classmethod
    def through(cls, seq_len: int, trials: Iterable[Trial], limit_bytes: int) -> LengthLine | None:
        """The line of the search's own memory model (``MemoryModel``, fitted to the trials that fitted at this
        length) that decides its edge under ``limit_bytes``; ``None`` with fewer than two trials that fitted.

        >>> trials = [Trial(2, True, 300, 0.1, phase_peak_bytes={"backward": 300}),
        ...           Trial(10, True, 1100, 0.1, phase_peak_bytes={"backward": 1100})]
        >>> line = LengthLine.through(64, trials, 5000)
        >>> line.fixed_bytes, line.bytes_per_row
        (100.0, 100.0)
        """
        model = MemoryModel.fit(list(trials))
        if model is None or model.kind == "conservative":
            return None
        line = model.binding_line(limit_bytes)
        return None if line is None else cls(seq_len, *line)


@dataclass(frozen=True)
class TokenMemoryFit:
    """``peak(B, L) = fixed_bytes + B * (bytes_per_token * L + bytes_per_squared_token * L**2)``."""

    fixed_bytes: float
    bytes_per_token: float
    bytes_per_squared_token: float
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, lines: Iterable[LengthLine]) -> TokenMemoryFit | None:
        """The fit through every length's line (``None`` without one). One length gives no squared term;
        two or more fit both terms by least squares, the squared one held at zero rather than negative.

        >>> fit = TokenMemoryFit.of([LengthLine(10, 50.0, 10 * 3 + 100 * 0.5), LengthLine(20, 50.0, 20 * 3 + 400 * 0.5)])
        >>> round(fit.bytes_per_token, 6), round(fit.bytes_per_squared_token, 6), fit.fixed_bytes
        (3.0, 0.5, 50.0)
        """
        lines = sorted(lines, key=lambda line: line.seq_len)
        if not lines:
            return None
        fixed = sum(line.fixed_bytes for line in lines) / len(lines)
        per_token, per_squared = _least_squares(lines)
        return cls(fixed, per_token, per_squared, tuple(line.seq_len for line in lines))

    def bytes_per_row(self, seq_len: int) -> float:
        return self.bytes_per_token * seq_len + self.bytes_per_squared_token * seq_len**2

    def peak_bytes(self, batch_size: int, seq_len: int) -> float:
        """The predicted peak of ``batch_size`` rows of ``seq_len`` tokens."""
        return self.fixed_bytes + batch_size * self.bytes_per_row(seq_len)

    def largest_batch_size(self, seq_len: int, limit_bytes: int) -> int:
        """The largest size predicted to fit in ``limit_bytes`` at ``seq_len`` (at least 1: a guess to try)."""
        return max(1, math.floor((limit_bytes - self.fixed_bytes) / self.bytes_per_row(seq_len)))

    def to_dict(self) -> dict[str, float | list[int]]:
        return {
            "fixed_bytes": round(self.fixed_bytes),
            "bytes_per_token": round(self.bytes_per_token, 3),
            "bytes_per_squared_token": round(self.bytes_per_squared_token, 6),
            "from_lengths": list(self.lengths),
        }


def _least_squares(lines: list[LengthLine]) -> tuple[float, float]:
    """``bytes_per_row = a * L + c * L**2`` over the lines (no constant: a row of no tokens holds nothing)."""
    if len(lines) == 1:
        return lines[0].bytes_per_row / lines[0].seq_len, 0.0
    # The normal equations of the two-term fit, solved in closed form.
    s2 = sum(line.seq_len**2 for line in lines)
    s3 = sum(line.seq_len**3 for line in lines)
    s4 = sum(line.seq_len**4 for line in lines)
    y1 = sum(line.bytes_per_row * line.seq_len for line in lines)
    y2 = sum(line.bytes_per_row * line.seq_len**2 for line in lines)
    determinant = s2 * s4 - s3 * s3
    squared = (s2 * y2 - s3 * y1) / determinant if determinant else 0.0
    if squared <= 0:
        return y1 / s2, 0.0
    return (y1 - squared * s3) / s2, squared
