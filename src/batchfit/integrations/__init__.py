"""Integrations with training frameworks, each an optional extra imported only when used.

``batchfit.integrations.lightning`` (``pip install 'batchfit[lightning]'``),
``batchfit.integrations.transformers`` (``[transformers]``) and ``batchfit.integrations.mlx``
(``[mlx]``). ``import batchfit`` imports none of them.
"""
