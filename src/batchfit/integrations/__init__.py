"""Integrations with training frameworks, each an optional extra imported only when used.

``batchfit.integrations.lightning`` (``pip install 'batchfit[lightning]'``),
``batchfit.integrations.transformers`` (``[transformers]``) and ``batchfit.integrations.mlx``
(``[mlx]``). ``import batchfit`` imports none of them. ``batchfit.integrations.result`` holds what
the Lightning and Transformers integrations share, with no framework import: ``FitResult`` (the
same field names for what both set) and ``search_and_plan`` (one treatment of the global batch).

May import every core layer (``step``, ``devices``, ``search``, ``runtime``, ``planning``, ``sweep``) and
its own framework, only inside its own module; never ``cli``.
"""
