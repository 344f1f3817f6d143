"""What a workflow says while it works, for whoever shows it.

A workflow takes a ``Progress`` and calls ``working(text)`` around each long step (a search, a trace, a
real trial), ``said(line)`` for each finding as it is made ("Traced rank 0 of 8 ...: the largest micro-batch
per rank is 6.") and ``verified(check)`` when one rank's real trials have checked a traced answer. The base
class says nothing: a library call is silent unless it passes a ``Progress`` of its own; the command line
passes one that prints.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

from batchfit.workflows.verdict import PlanVerification


class Progress:
    """Silent by default; override what you want to show.

    >>> class Lines(Progress):
    ...     def said(self, line: str) -> None:
    ...         print(line)
    >>> Lines().said("Measured on sim:8.0MiB: the largest micro-batch is 9.")
    Measured on sim:8.0MiB: the largest micro-batch is 9.
    """

    def working(self, text: str) -> AbstractContextManager[None]:
        """A context around a long step, ``text`` saying what it is (a spinner's words)."""
        return contextlib.nullcontext()

    def said(self, line: str) -> None:
        """One finding, a plain sentence."""

    def verified(self, check: PlanVerification) -> None:
        """One rank's real trials checked each traced answer: the rows, and what was replaced."""


SILENT = Progress()
