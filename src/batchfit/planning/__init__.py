"""Maths of the batch plan, with no torch: micro-batch, accumulation and device arithmetic, learning-rate
scaling and warmup, batch-size advice, and the gradient noise scale (critical batch, tradeoffs, goodput).

``plan_batch``'s inputs come in four frozen, checked groups (``planning.config``): ``BatchTarget``,
``LearningRateConfig``, ``TrainingRun`` and ``AdviceInputs``.

Imports nothing of batchfit outside ``planning``, and no torch at module level.
"""
