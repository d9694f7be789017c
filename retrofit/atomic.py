"""Writes that leave nothing half-written: a temporary file or directory beside the target, renamed over it at the end
(and :func:`torch_load`, the reader of what :func:`torch_save` writes).

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


def torch_load(path: str | os.PathLike, what: str, map_location: Any = "cpu", advice: str = "") -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values only, so a file holding any other object is
    refused, never run. Any failure is one ``RetrofitError`` naming the file as ``what`` (e.g. "a training
    checkpoint"), with ``advice`` appended: a damaged file fails inside the unpickler in many ways (EOFError,
    IndexError, UnpicklingError, ...)."""
    import pickle

    import torch

    from retrofit.errors import RetrofitError

    suffix = f"; {advice}" if advice else ""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        refused = next((line.strip() for line in str(error).splitlines() if "Unsupported global" in line), None)
        if refused is None:  # the unpickler met bytes that are no pickle at all
            raise RetrofitError(f"{path}: cannot read {what}, the file is damaged (UnpicklingError){suffix}") from None
        raise RetrofitError(f"{path}: refusing to load {what} that holds more than tensors and plain values "
                            f"({refused[:160]}){suffix}") from None
    except Exception as error:  # noqa: BLE001 - see the docstring
        raise RetrofitError(f"{path}: cannot read {what}, the file is damaged ({type(error).__name__}){suffix}") from None
