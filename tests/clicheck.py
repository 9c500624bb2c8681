"""The one check every CLI test of bad input makes: exit 2, nothing on stdout, one line on stderr."""


def assert_one_line_error(result, message: str) -> None:
    """``result`` of CliRunner.invoke failed as the README promises, with ``message`` in its one line."""
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroplan: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.output
