"""Reading text that users name on the command line (calibration books, evaluation text, haystacks): UTF-8 text or a
one-line refusal naming the file. Binary files, other encodings and empty files never reach a tokenizer."""
from __future__ import annotations

from pathlib import Path

from retrofit.errors import RetrofitError

# Share of the characters that must be letters, digits, punctuation or whitespace for a file to count as text: natural
# text in any script is far above it; random or compressed bytes that happen to decode as UTF-8 are far below.
MIN_PRINTABLE_SHARE = 0.9


def read_text(path: str | Path, what: str = "text file") -> str:
    """The whole file as a string; RetrofitError ``"<what> <path>: <why>"`` when it is missing, empty, not UTF-8,
    or mostly not text (control characters)."""
    path = Path(path)
    if not path.is_file():
        raise RetrofitError(f"{what} {path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RetrofitError(f"{what} {path}: not UTF-8 text (undecodable byte at offset {error.start})") from None
    check_text(text, path, what)
    return text


def check_text(text: str, path: str | Path, what: str = "text file") -> None:
    """RetrofitError unless ``text`` (read from ``path``) has content and is mostly printable."""
    if not text.strip():
        raise RetrofitError(f"{what} {path} is empty")
    sample = text[: 1 << 20]
    if _printable_but_line_breaks_and_tabs(sample):
        return
    printable = sum(character.isprintable() or character.isspace() for character in sample)
    if printable < MIN_PRINTABLE_SHARE * len(sample):
        raise RetrofitError(f"{what} {path}: not text ({100 * (1 - printable / len(sample)):.0f}% control characters)")


def _printable_but_line_breaks_and_tabs(sample: str) -> bool:
    """True when every character is printable once line breaks and tabs are set aside: the common case, decided by
    C string methods in about a tenth of the per-character count's time (which a calibration run pays per book and
    per reading). False sends the sample to the exact count (other whitespace, such as no-break spaces, counts as
    text there)."""
    return sample.replace("\n", "").replace("\r", "").replace("\t", "").isprintable()
