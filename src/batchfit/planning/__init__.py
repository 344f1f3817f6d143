"""Maths of the batch plan, with no torch: micro-batch, accumulation and device arithmetic, learning-rate
scaling and warmup, batch-size advice, and the gradient noise scale (critical batch, tradeoffs, goodput).

Imports nothing of batchfit outside ``planning``, and no torch at module level.
"""
