"""The workflows: what the commands do, for a library user to call.

A workflow strings the core together for one question: ``plan_workload`` (measure the micro-batch, plan, and
measure again with the accumulation window's gradients held when the plan accumulates), ``plan_sharded`` (a
model from its config per rank under FSDP2: the checkpointing choice, its advice, the held-gradient re-trace,
one rank's real trials to verify), ``estimate_config`` and ``estimate_own_rank`` (per rank without the
hardware), and ``route_workload`` (which of those paths a workload takes). Each returns a typed result and
says what it finds through a ``Progress`` (silent by default). The command line parses its options, calls
one workflow and prints; the integrations call the same workflows.

May import every layer below it (``step``, ``devices``, ``search``, ``planning``, ``runtime``, ``sweep``,
``parallel``); never ``cli`` or ``integrations``.
"""

from __future__ import annotations

from batchfit.workflows.progress import SILENT
from batchfit.workflows.progress import Progress
from batchfit.workflows.rank_workloads import accumulating
from batchfit.workflows.rank_workloads import rank_workload
from batchfit.workflows.routing import DEFAULT_SEQ_LEN
from batchfit.workflows.routing import Route
from batchfit.workflows.routing import from_config
from batchfit.workflows.routing import route_workload
from batchfit.workflows.sharded_estimate import ConfigEstimate
from batchfit.workflows.sharded_estimate import RankEstimate
from batchfit.workflows.sharded_estimate import estimate_config
from batchfit.workflows.sharded_estimate import estimate_own_rank
from batchfit.workflows.sharded_plan import ShardedPlan
from batchfit.workflows.sharded_plan import plan_sharded
from batchfit.workflows.sharded_tokens import ShardedTokenBudget
from batchfit.workflows.sharded_tokens import sharded_token_budget
from batchfit.workflows.verdict import PlanVerification
from batchfit.workflows.verification import verification_device
from batchfit.workflows.workload_plan import WorkloadPlan
from batchfit.workflows.workload_plan import measure_micro_batch
from batchfit.workflows.workload_plan import plan_workload

__all__ = [
    "DEFAULT_SEQ_LEN",
    "SILENT",
    "ConfigEstimate",
    "PlanVerification",
    "Progress",
    "RankEstimate",
    "Route",
    "ShardedPlan",
    "ShardedTokenBudget",
    "WorkloadPlan",
    "accumulating",
    "estimate_config",
    "estimate_own_rank",
    "from_config",
    "measure_micro_batch",
    "plan_sharded",
    "plan_workload",
    "rank_workload",
    "route_workload",
    "sharded_token_budget",
    "verification_device",
]
