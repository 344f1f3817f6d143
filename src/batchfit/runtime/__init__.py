"""Training that keeps going: the Microbatcher that shrinks the micro-batch after an OOM and keeps the
global batch exact, the EvalMicrobatcher that does the same for evaluation, the GradientAccumulator, the
``executable_batch_size`` decorator, and what is measured while training (gradient noise scale, the
critical batch by short runs). Agreement across ``torch.distributed`` ranks lives in ``search``, whose
loop needs it too.

May import ``step``, ``devices``, ``search``, ``planning`` and ``errors``.
"""
