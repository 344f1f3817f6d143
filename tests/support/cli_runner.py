"""The ``batchfit`` command run in-process, as the CLI tests run it: typer's ``CliRunner`` on the app, with a wide
terminal so that no table or message wraps."""

from __future__ import annotations

from typer.testing import CliRunner

from batchfit.cli.app import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def refused(result, *words: str) -> None:
    """The command was refused as bad input: exit 2, one ``error:`` line naming every word, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    for word in words:
        assert word in lines[0], lines[0]
