"""A GGUF file parsed once per load.

transformers reads a GGUF file's metadata three times to load one model (for its config, its tokenizer and its
weights: each a new ``gguf.GGUFReader``, which walks every metadata field element by element), and asks gguf-py for its
tensor-name map once per module of the model (397 times for SmolLM2-135M, each map built from scratch). The reader of
a file and the map of an architecture do not change within a load, so inside :func:`parsed_once` both are made once
and shared. The tensors, the dequantization and everything transformers does with them are untouched: the weights are
the bits a plain ``from_pretrained(..., gguf_file=...)`` gives. Measured in BENCHMARKS.md (Current figures >
Loading: 2.7x faster for SmolLM2-135M).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Iterator

_installed = threading.Lock()   # one memo installed at a time; nested or concurrent loads share it
_depth = 0


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` returns one reader per file (keyed by its resolved path, size and
    modification time, so a file rewritten in between is read again) and ``gguf.get_tensor_name_map(arch, n)`` one
    map per ``(arch, n)``. Outside it, gguf-py is as it was. Without gguf-py, or where it lacks either name, the block
    runs unchanged."""
    global _depth
    try:
        import gguf
    except ImportError:
        yield
        return
    reader_class = getattr(gguf, "GGUFReader", None)
    name_map = getattr(gguf, "get_tensor_name_map", None)
    if reader_class is None or name_map is None:
        yield
        return
    with _installed:
        _depth += 1
        if _depth == 1:
            gguf.GGUFReader = _reading_once(reader_class)
            gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        with _installed:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _reading_once(reader_class):
    readers: dict[tuple, object] = {}

    def reader(path, mode: str = "r"):
        status = os.stat(path)
        key = (os.path.realpath(path), mode, status.st_size, status.st_mtime_ns)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    return reader
