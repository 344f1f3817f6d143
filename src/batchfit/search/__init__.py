"""Measured answers: trials of a workload on a device and what is built from them. The prober (one
trial: full steps, state restored), the strategies that pick the next size, the memory model, the
search loop and its result, the result cache and fingerprint, and the memory estimate (one trial on the
trace device, with its breakdown, and the analytic formula). The throughput-optimal batch, built on the
search, is the ``throughput`` layer above it.

May import ``step``, ``devices`` and ``errors``; never ``runtime``, ``sweep``, ``cli`` or ``integrations``.
"""
