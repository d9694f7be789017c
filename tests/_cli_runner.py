"""Running the real `retrofit` click group in-process, and the one-line error contract (exit 2, one stderr line)."""
from __future__ import annotations

from click.testing import CliRunner

from retrofit._entry import cli_module


def run(*args: str):
    return CliRunner().invoke(cli_module().main, list(args))


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
