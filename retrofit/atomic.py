"""Writes that leave nothing half-written: a temporary file or directory beside the target, renamed over it at the end.

    with atomic_path(out / "report.json") as tmp:
        tmp.write_text(...)

An exception inside the block removes the temporary and leaves the target as it was. Renames within one directory
are atomic on POSIX, so a reader sees the old target or the new one, never a part.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path`` (an empty directory when ``directory``) to write; on a clean exit
    it replaces ``path`` (an existing directory is moved aside first, then removed), on an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        temporary = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    else:
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(handle)
        temporary = Path(name)
    try:
        yield temporary
        if directory and path.is_dir():
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, aside / path.name)
            os.replace(temporary, path)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(temporary, path)
    finally:
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        elif temporary.exists():
            temporary.unlink()


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically; returns ``path``."""
    with atomic_path(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)


def write_json(path: str | os.PathLike, payload: Any) -> Path:
    """Write ``payload`` as indented JSON (a newline at the end) to ``path`` atomically; returns ``path``."""
    return write_text(path, json.dumps(payload, indent=2) + "\n")


def torch_save(payload: Any, path: str | os.PathLike) -> Path:
    """``torch.save(payload, path)`` atomically; returns ``path``."""
    import torch

    with atomic_path(path) as temporary:
        torch.save(payload, temporary)
    return Path(path)
