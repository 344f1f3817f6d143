"""The ``batchfit`` command: the typer app and its commands, each a face (options and help, light to import) over
a body that loads the library when it runs (``batchfit.cli.commands`` and the modules it names)."""

from __future__ import annotations

from batchfit.cli import allocator as allocator_command  # noqa: F401  (registers allocator)
from batchfit.cli import commands  # noqa: F401  (registers find, estimate, optimal, plan, list-workloads)
from batchfit.cli import critical  # noqa: F401  (registers critical)
from batchfit.cli import sweep  # noqa: F401  (registers sweep and cache)
from batchfit.cli import tokens as tokens_command  # noqa: F401  (registers tokens)
from batchfit.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
