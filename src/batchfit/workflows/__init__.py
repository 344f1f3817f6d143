"""The workflows: what the commands do, for a library user to call.

A workflow strings the core together for one question, each in its own module:

- ``find``: ``find_max_batch_size`` and ``probe_batch_size`` (``bf.find_max_batch_size``), a model and a sample
  batch searched, as one rank of a world under FSDP2 where ``parallelism`` is given;
- ``workload_plan``: ``plan_workload`` (measure the micro-batch, plan, and measure again with the accumulation
  window's gradients held when the plan accumulates);
- ``sharded_plan``: ``plan_sharded`` (a model from its config per rank under FSDP2: the checkpointing choice,
  its advice, the held-gradient re-trace, one rank's real trials to verify);
- ``sharded_estimate``: ``estimate_config`` and ``estimate_own_rank`` (per rank without the hardware);
- ``sharded_tokens``: ``sharded_token_budget`` (token budgets per rank);
- ``routing``: ``route_workload`` (which of those paths a workload takes).

Each returns a typed result and says what it finds through a ``Progress`` (``progress``; silent by default).
The command line parses its options, calls one workflow and prints; the integrations call the same workflows.
Import each from its module (``from batchfit.workflows.sharded_plan import plan_sharded``): this package loads
none of them, so ``import batchfit`` (which takes ``find``) does not load the FSDP2 layer.

May import every layer below it (``step``, ``devices``, ``search``, ``planning``, ``runtime``, ``sweep``,
``parallel``, ``tokens``, ``throughput``); never ``cli`` or ``integrations``.
"""
