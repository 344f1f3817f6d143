"""Fail early, in one line naming the fix, where MLX is not installed.

Imported first by ``batchfit.integrations.mlx``; every other module of the package imports MLX freely.
"""

INSTALL_HINT = 'pip install "batchfit[mlx]"'

try:
    import mlx.core  # noqa: F401
except ImportError as error:  # exercised only where mlx is missing
    raise ImportError(
        f"batchfit's MLX backend needs MLX, which is not installed: {INSTALL_HINT} "
        '(Apple silicon; on Linux pip install "mlx[cpu]")',
        name="mlx",
    ) from error
