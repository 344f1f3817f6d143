"""What a token-budget run found: per bucket the largest padded batch, the packed budget, and the fit."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

from batchfit.search.result import SearchResult
from batchfit.search.trial import Trial
from batchfit.tokens.memory_fit import TokenMemoryFit

MODES = {"train": "training", "eval": "forward only (scoring, log-probs)"}


def _per_second(tokens: int, trial: Trial | None) -> float | None:
    """Tokens per second of ``trial``'s last step (the first also makes the optimizer's state)."""
    if trial is None or not trial.step_seconds or trial.step_seconds[-1] <= 0:
        return None
    return tokens / trial.step_seconds[-1]


def _answer_trial(search: SearchResult) -> Trial | None:
    """The last trial that fitted at the answer."""
    return next((t for t in reversed(search.trials) if t.fits and t.batch_size == search.batch_size), None)


@dataclass
class BucketBudget:
    """One bucket: ``batch_size`` padded sequences of ``seq_len`` tokens (its longest) fit, one more does not,
    both tried (``search``); ``guess`` is where the fit of earlier buckets sent the search first."""

    seq_len: int
    search: SearchResult
    guess: int | None = None

    @property
    def batch_size(self) -> int:
        return self.search.batch_size

    @property
    def tokens(self) -> int:
        """The padded micro-batch's tokens: rows times the bucket's longest length (padding counts)."""
        return self.batch_size * self.seq_len

    @property
    def tokens_per_second(self) -> float | None:
        return _per_second(self.tokens, _answer_trial(self.search))

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "tokens": self.tokens,
            "exact": self.search.exact,
            "guess": self.guess,
            "peak_bytes": self.search.peak_bytes,
            "tokens_per_second": self.tokens_per_second,
            "trials": [trial.to_dict() for trial in self.search.trials],
        }


@dataclass
class PackedBudget:
    """Packed micro-batches (sequences laid end to end): ``tokens`` fit, one more does not, at the composition
    that binds. Each of ``searches`` (a composition's sequence length -> its search) packs sequences of one
    length: the longest bucket's (the most attention per token) and the shortest's (the most sequences per
    token). Where memory per sequence is a constant plus terms in its length and its square, no mix of
    lengths between the two costs more per token than the dearer of them. ``skipped`` says why nothing
    was measured."""

    searches: dict[int, SearchResult] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def search(self) -> SearchResult | None:
        """The binding composition's search (the fewest tokens)."""
        return min(self.searches.values(), key=lambda search: search.batch_size, default=None)

    @property
    def seq_len(self) -> int | None:
        """The binding composition's sequence length."""
        binding = self.search
        return next((length for length, search in self.searches.items() if search is binding), None)

    @property
    def tokens(self) -> int | None:
        return self.search.batch_size if self.search is not None else None

    @property
    def trials(self) -> int:
        return sum(len(search.trials) for search in self.searches.values())

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.search is None else _per_second(self.search.batch_size, _answer_trial(self.search))

    def to_dict(self) -> dict[str, Any]:
        if self.search is None:
            return {"tokens": None, "skipped": self.skipped}
        return {
            "tokens": self.tokens,
            "seq_len": self.seq_len,
            "by_seq_len": {str(length): search.batch_size for length, search in self.searches.items()},
            "exact": self.search.exact,
            "peak_bytes": self.search.peak_bytes,
            "tokens_per_second": self.tokens_per_second,
            "trials": [trial.to_dict() for search in self.searches.values() for trial in search.trials],
        }


@dataclass
class ModeBudget:
    """The budgets of one mode: ``"train"`` (forward, backward, optimizer step) or ``"eval"`` (forward only).
    ``buckets`` are the lengths where a sequence fits; ``too_long`` maps each length where not even one does to
    the trials that showed it."""

    mode: str
    buckets: list[BucketBudget]
    packed: PackedBudget | None
    fit: TokenMemoryFit | None
    too_long: dict[int, list[Trial]] = field(default_factory=dict)

    @property
    def trials(self) -> int:
        packed = self.packed.trials if self.packed is not None else 0
        failed = sum(len(trials) for trials in self.too_long.values())
        return sum(len(bucket.search.trials) for bucket in self.buckets) + packed + failed

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "buckets": [bucket.to_dict() for bucket in self.buckets],
            "too_long": [
                {"seq_len": seq_len, "trials": [trial.to_dict() for trial in trials]}
                for seq_len, trials in self.too_long.items()
            ],
            "packed": self.packed.to_dict() if self.packed is not None else None,
            "fit": self.fit.to_dict() if self.fit is not None else None,
            "trials": self.trials,
        }


@dataclass
class TokenBudget:
    """A ``find_token_budget`` run: ``training`` (and ``forward``, when asked) on ``device``.

    ``trials`` counts every trial run; ``lines`` are ready settings for the stacks that batch by tokens
    (``batchfit.tokens.stacks``).
    """

    workload: str
    device: str
    capacity_bytes: int | None
    limit_bytes: int | None
    training: ModeBudget
    forward: ModeBudget | None = None
    seconds: float = 0.0
    accumulating: bool = True
    """Training measured as a later micro-batch of an accumulation window (the window's gradients held)."""
    lines: dict[str, list[str]] = field(default_factory=dict)

    @property
    def modes(self) -> list[ModeBudget]:
        return [mode for mode in (self.training, self.forward) if mode is not None]

    @property
    def trials(self) -> int:
        return sum(mode.trials for mode in self.modes)

    @property
    def lengths(self) -> list[int]:
        """The buckets' longest lengths where training fits a sequence (see ``too_long`` for the others)."""
        return [bucket.seq_len for bucket in self.training.buckets]

    @property
    def too_long(self) -> list[int]:
        """The buckets' longest lengths where not even one sequence fits in training."""
        return list(self.training.too_long)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the device, every bucket's answer and trials, the packed budgets, the fits and the lines."""
        return {
            "workload": self.workload,
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "limit_bytes": self.limit_bytes,
            "lengths": self.lengths,
            "too_long": self.too_long,
            "accumulating": self.accumulating,
            "training": self.training.to_dict(),
            "forward": self.forward.to_dict() if self.forward is not None else None,
            "trials": self.trials,
            "seconds": round(self.seconds, 3),
            "lines": self.lines,
        }
