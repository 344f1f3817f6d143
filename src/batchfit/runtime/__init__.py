"""Training that keeps going: the Microbatcher that shrinks the micro-batch after an OOM and keeps the
global batch exact, the GradientAccumulator, the ``executable_batch_size`` decorator, agreement across
``torch.distributed`` ranks, and what is measured while training (gradient noise scale, the critical
batch by short runs).

May import ``step``, ``devices``, ``search``, ``planning`` and ``errors``.
"""
