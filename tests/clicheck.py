"""The CLI tests' shared helpers: invoke a command in-process, read its JSON, and the one check every test
of bad input makes (exit 2, nothing on stdout, one line on stderr)."""

import json

from typer.testing import CliRunner

from zeroplan.cli import app

runner = CliRunner()


def run(*args: str):
    """``zeroplan ARGS`` in-process (typer's CliRunner)."""
    return runner.invoke(app, list(args))


def run_json(*args: str) -> dict:
    """``zeroplan ARGS --json``, which must succeed, parsed."""
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_one_line_error(result, message: str) -> None:
    """``result`` of CliRunner.invoke failed as the README promises, with ``message`` in its one line."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output
