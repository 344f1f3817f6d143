"""Token budgets for variable-length training: the largest padded batch per sequence-length bucket and the
largest packed micro-batch in tokens, each found by the search and tried with one more failing; a fit of
fixed + per-token + per-squared-length bytes that starts each bucket's search near its edge; ready lines for
the stacks that batch by tokens. Imports step, devices and search; workflows and the CLI import it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "find_token_budget": "batchfit.tokens.budget",
        "token_budget_of_workload": "batchfit.tokens.budget",
        "bucket_lengths": "batchfit.tokens.lengths",
        "TokenMemoryFit": "batchfit.tokens.memory_fit",
        "BucketBudget": "batchfit.tokens.result",
        "ModeBudget": "batchfit.tokens.result",
        "PackedBudget": "batchfit.tokens.result",
        "TokenBudget": "batchfit.tokens.result",
    },
)

if TYPE_CHECKING:
    from batchfit.tokens.budget import find_token_budget
    from batchfit.tokens.budget import token_budget_of_workload
    from batchfit.tokens.lengths import bucket_lengths
    from batchfit.tokens.memory_fit import TokenMemoryFit
    from batchfit.tokens.result import BucketBudget
    from batchfit.tokens.result import ModeBudget
    from batchfit.tokens.result import PackedBudget
    from batchfit.tokens.result import TokenBudget

__all__ = [
    "BucketBudget",
    "ModeBudget",
    "PackedBudget",
    "TokenBudget",
    "TokenMemoryFit",
    "bucket_lengths",
    "find_token_budget",
    "token_budget_of_workload",
]
