"""``--sparse-arg k=v`` strings -> keyword arguments of a sparse method, typed by its dataclass fields; the kernel
choices a sparse session takes."""
from __future__ import annotations

from typing import Any

from retrofit.cliargs import coerce, parse_pairs
from retrofit.errors import RetrofitError
from retrofit.sparse.registry import METHODS, PARAMETER, method_fields

# kernel=... of sparse_decoding and sparse_prefill -> the kernels' backend for the session's ops
KERNELS = {"auto": "auto", "triton": "triton", "reference": "torch"}


def parse_sparse_args(args: list[str] | tuple[str, ...], method: str | None = None) -> dict[str, Any]:
    """Parse CLI ``k=v`` strings into a dict; with ``method`` the values are typed by its dataclass fields.

    >>> parse_sparse_args(["page_size=16", "dense_layers=0,1"], method="quest")
    {'page_size': 16, 'dense_layers': (0, 1)}
    """
    parsed: dict[str, Any] = parse_pairs(args, "--sparse-arg")
    if method is not None:
        fields = method_fields(METHODS.get(method))
        for key in parsed:
            if key not in fields:
                raise RetrofitError(
                    f"unknown parameter {key!r} for sparse method {method!r}; it takes: {', '.join(sorted(fields))}")
        parsed = {key: coerce(value, fields[key], key, PARAMETER) for key, value in parsed.items()}
    return parsed
