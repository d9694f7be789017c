"""Checks of a model directory's files before transformers reads them, so a damaged checkpoint is named in one line
(which file, what is wrong) instead of surfacing as a parser's traceback."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from retrofit.errors import RetrofitError

# A safetensors file: an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
# data_offsets: [begin, end]}, "__metadata__": {...}}), then the tensor bytes the offsets index.
_HEADER_LIMIT = 100 << 20


def read_config(directory: str | Path) -> dict[str, Any]:
    """``directory/config.json`` as a dict; RetrofitError naming the file when it is missing or not a JSON object."""
    path = Path(directory) / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RetrofitError(f"{directory} is not a model directory (no config.json in it)") from None
    except UnicodeDecodeError:
        raise RetrofitError(f"{path}: not a JSON text file") from None
    except json.JSONDecodeError as error:
        raise RetrofitError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})") \
            from None
    if not isinstance(values, dict):
        raise RetrofitError(f"{path}: expected a JSON object of model settings")
    return values


def check_safetensors(path: str | Path) -> None:
    """RetrofitError naming ``path`` unless its header parses and every tensor's bytes lie inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise RetrofitError(f"{path}: not a safetensors file ({size} bytes, shorter than its header)")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(size - 8, _HEADER_LIMIT):
            raise RetrofitError(f"{path}: not a safetensors file, or truncated (its header claims {header_length} bytes, "
                                f"the file holds {size})")
        try:
            header = json.loads(handle.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RetrofitError(f"{path}: damaged safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise RetrofitError(f"{path}: damaged safetensors header (not a JSON object)")
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    needed = 8 + header_length + max(ends, default=0)
    if needed > size:
        raise RetrofitError(f"{path}: truncated ({size:,} of {needed:,} bytes); download or save it again")


def check_model_dir(directory: str | Path) -> dict[str, Any]:
    """Validate ``directory``'s config.json and weight files; returns the config."""
    config = read_config(directory)
    for weights in sorted(Path(directory).glob("*.safetensors")):
        check_safetensors(weights)
    return config
