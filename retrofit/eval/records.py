"""Reading task files of one JSON record per line, with one-line errors that name the file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, TypeVar

from retrofit.errors import RetrofitError

Item = TypeVar("Item")


def read_jsonl(path: Path, build: Callable[[dict[str, Any]], Item], what: str, fields: str,
               limit: int | None = None) -> list[Item]:
    """``build(record)`` for the first ``limit`` non-empty lines of ``path``.

    ``build`` raises KeyError, TypeError or ValueError for a record that does not fit; that becomes a
    :class:`RetrofitError` ``"PATH:LINE: not a WHAT record FIELDS (reason)"``.
    """
    if not path.is_file():
        raise RetrofitError(f"data file not found: {path}")
    items: list[Item] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                items.append(build(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise RetrofitError(f"{path}:{number}: not a {what} record {fields} ({error})") from None
    return items
