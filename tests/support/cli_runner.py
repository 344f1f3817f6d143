"""The ``batchfit`` command run in-process, as the CLI tests run it: typer's ``CliRunner`` on the app, with a wide
terminal so that no table or message wraps."""

from __future__ import annotations

from typer.testing import CliRunner

from batchfit.cli.app import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})
