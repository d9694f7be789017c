"""Running the real `retrofit` click group in-process, and the one-line error contract (exit 2, one stderr line)."""
from __future__ import annotations

from click.testing import CliRunner

from retrofit._entry import cli_module


def run(*args: str):
    return CliRunner().invoke(cli_module().main, list(args))


def shown_lines(text: str) -> list[str]:
    """The non-empty lines a terminal shows for ``text``: a carriage return starts its line again, so a progress bar
    that was drawn and then cleared (tqdm's bars end so) leaves nothing."""
    shown = (line.rsplit("\r", 1)[-1].strip() for line in text.split("\n"))
    return [line for line in shown if line]


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = shown_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
