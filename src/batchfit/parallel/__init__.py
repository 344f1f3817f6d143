"""Sharded training (FSDP2) per rank, without the hardware: the world size and sharding settings,
a fake process group of any size, models built from their configs without memory, and one rank's
memory traced with torch's own ``fully_shard`` on fake tensors; and one rank's real trials at any
world size over the same fake process group (``find_rank_batch_size``).

May import ``step``, ``devices``, ``search`` and ``errors``; never ``cli`` or ``integrations``.
transformers is imported only inside the functions that build a Hugging Face model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchfit._lazy import lazy_names

__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "LargestBatch": "batchfit.parallel.fit",
        "largest_batch_size": "batchfit.parallel.fit",
        "LLM_PRESETS": "batchfit.parallel.models",
        "TinyTransformer": "batchfit.parallel.models",
        "model_config": "batchfit.parallel.models",
        "RankWorkload": "batchfit.parallel.one_rank",
        "Verification": "batchfit.parallel.one_rank",
        "find_rank_batch_size": "batchfit.parallel.one_rank",
        "probe_rank_batch_size": "batchfit.parallel.one_rank",
        "verify_largest": "batchfit.parallel.one_rank",
        "Parallelism": "batchfit.parallel.settings",
        "RankSession": "batchfit.parallel.trace",
        "ShardedEstimate": "batchfit.parallel.trace",
        "trace_rank": "batchfit.parallel.trace",
        "fake_world": "batchfit.parallel.world",
    },
)

if TYPE_CHECKING:
    from batchfit.parallel.fit import LargestBatch
    from batchfit.parallel.fit import largest_batch_size
    from batchfit.parallel.models import LLM_PRESETS
    from batchfit.parallel.models import TinyTransformer
    from batchfit.parallel.models import model_config
    from batchfit.parallel.one_rank import RankWorkload
    from batchfit.parallel.one_rank import Verification
    from batchfit.parallel.one_rank import find_rank_batch_size
    from batchfit.parallel.one_rank import probe_rank_batch_size
    from batchfit.parallel.one_rank import verify_largest
    from batchfit.parallel.settings import Parallelism
    from batchfit.parallel.trace import RankSession
    from batchfit.parallel.trace import ShardedEstimate
    from batchfit.parallel.trace import trace_rank
    from batchfit.parallel.world import fake_world

__all__ = [
    "LLM_PRESETS",
    "LargestBatch",
    "Parallelism",
    "RankSession",
    "RankWorkload",
    "ShardedEstimate",
    "TinyTransformer",
    "Verification",
    "fake_world",
    "find_rank_batch_size",
    "largest_batch_size",
    "model_config",
    "probe_rank_batch_size",
    "trace_rank",
    "verify_largest",
]
