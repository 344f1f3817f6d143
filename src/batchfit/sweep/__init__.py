"""The largest batch per configuration of a grid: the sweep's entry point, its runner, the results file
(resumable, written atomically), scaling rules and the cross-configuration memory model.

May import ``step``, ``devices``, ``search``, ``runtime``, ``planning`` and ``errors``; never ``cli``.
"""
