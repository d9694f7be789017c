"""Is an evaluation file held out from a conversion's calibration data? A report scored on text the conversion
distilled on would measure what it saw, not what it kept.

Two checks, before any model work, each ending in a one-line :class:`RetrofitError` that names both files:

- the same content: the SHA-256 of an evaluation file's bytes equals a calibration file's (a copy under any name);
- the text inside a calibration file: for an evaluation TEXT, ``PASSAGES`` passages of ``PASSAGE_CHARS`` characters
  at evenly spaced offsets of its whitespace-normalised text (runs of whitespace read as one space, so re-wrapped
  lines and other line endings still match) are searched in each whitespace-normalised calibration text; one found
  passage is enough (200 characters of running text do not recur by chance). A calibration file holding 3% of the
  text is found with probability 1 - 0.97^128 = 98%, one holding all of it always; a few sentences may pass.

About a second per 25 MB of calibration text (2 CPU cores).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.textfiles import read_text

PASSAGES = 128
PASSAGE_CHARS = 200


def content_digest(path: Path) -> str:
    """SHA-256 (hex) of the file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def normalised(text: str) -> str:
    """``text`` with every run of whitespace as one space, stripped."""
    return " ".join(text.split())


def sampled_passages(text: str, count: int = PASSAGES, chars: int = PASSAGE_CHARS) -> list[str]:
    """Up to ``count`` non-overlapping passages of ``chars`` characters at evenly spaced offsets of the
    whitespace-normalised ``text`` (none when it is shorter than one passage)."""
    flat = normalised(text)
    fitting = min(count, len(flat) // chars)
    if fitting == 0:
        return []
    stride = len(flat) // fitting
    return [flat[index * stride:index * stride + chars] for index in range(fitting)]


def check_held_out(evaluation: list[Path], text_files: list[Path], calibration: list[Path]) -> None:
    """RetrofitError when an ``evaluation`` file has the content of a ``calibration`` file, or when sampled passages
    of one of the ``text_files`` (evaluation texts, also in ``evaluation``) stand in a calibration file."""
    calibration_digests = {content_digest(path): path for path in calibration}
    for path in evaluation:
        twin = calibration_digests.get(content_digest(path))
        if twin is not None:
            raise RetrofitError(f"evaluation file {path} has the same content as the calibration file {twin} "
                                "(--data): the report would score text the conversion distilled on; calibrate on "
                                "other files or evaluate on another text")
    passages = {path: sampled_passages(read_text(path, "evaluation text")) for path in text_files}
    if not any(passages.values()):
        return
    for source in calibration:
        flat = normalised(read_text(source, "calibration file"))
        for path, sampled in passages.items():
            found = sum(passage in flat for passage in sampled)
            if found:
                raise RetrofitError(f"the calibration file {source} (--data) contains the evaluation text {path} "
                                    f"({found} of {len(sampled)} sampled passages of {PASSAGE_CHARS} characters): "
                                    "the report would score text the conversion distilled on; calibrate on other "
                                    "files or evaluate on another text")
