"""The sparse-decoding method contract, the method registry and CLI argument parsing.

A method is a small dataclass (validated in ``__post_init__``) with two hooks the cache and the patch call:

- ``prepare(layer, start, end)``: positions ``[start, end)`` were just written to ``layer``'s key/value buffers
  (prefill or an appended token); update the method's metadata in ``layer.meta`` (page min/max, centroids, ANN
  index, gate keys);
- ``select(layer, query) -> Selection | None``: which blocks of the cache one decode query reads (``None``: dense).

Everything else (storage, padding, the attention kernel, restoring the model) is shared.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from retrofit.errors import RetrofitError
from retrofit.registry import Registry

if TYPE_CHECKING:
    from retrofit.sparse.cache import SparseLayer

METHODS: Registry[type["SparseMethod"]] = Registry("sparse method")


@dataclass
class Selection:
    """The blocks one decode step attends to, per (batch, kv head).

    indices [B, Hkv, S] int32 block ids (a block is ``block_size`` consecutive buffer positions), counts [B, Hkv]
    int32 number of valid entries per row (ragged; entries past the count are ignored).
    """

    indices: torch.Tensor
    counts: torch.Tensor
    block_size: int = 1


@dataclass
class SparseMethod(ABC):
    """Base of every sparse method. ``budget``: tokens read per kv head per decode step (sinks and window included)."""

    budget: int
    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = False

    def __post_init__(self) -> None:
        require(isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget > 0,
                "budget", self.budget, "a positive number of tokens")

    def prepare(self, layer: "SparseLayer", start: int, end: int) -> None:
        """Update ``layer.meta`` after positions ``[start, end)`` were written (default: no metadata)."""

    def append(self, layer: "SparseLayer", keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new keys/values [B, Hkv, T, D] (default: append at the common write position)."""
        layer.write(keys, values)

    @abstractmethod
    def select(self, layer: "SparseLayer", query: torch.Tensor) -> Selection | None:
        """Blocks read by the decode query [B, Hq, D] (post-RoPE), or None to attend densely."""

    def metadata_bytes(self, layer: "SparseLayer") -> dict[str, int]:
        """Bytes held by this method's metadata of one layer, per component (default: tensors in layer.meta)."""
        return {"metadata": sum(t.numel() * t.element_size() for t in layer.meta.values()
                                if isinstance(t, torch.Tensor))}


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """Raise a one-line RetrofitError naming the field when a parameter is invalid."""
    if not ok:
        raise RetrofitError(f"sparse method parameter {field}={value!r} is invalid: expected {expected}")


def register(name: str):
    """Class decorator: register a SparseMethod subclass under ``name``."""

    def add(cls: type[SparseMethod]) -> type[SparseMethod]:
        cls.name = name
        return METHODS.register(name)(cls)

    return add


def _coerce(value: Any, annotation: Any, field: str) -> Any:
    if not isinstance(value, str):
        if isinstance(value, list):
            return tuple(value)
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null", "") and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, field)
            except RetrofitError:
                continue
        raise RetrofitError(f"sparse method parameter {field}={value!r} is invalid: expected {annotation}")
    try:
        if annotation is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if annotation in (int, float):
            return annotation(value)
        if origin is tuple:
            item = args[0] if args else str
            return tuple(_coerce(part.strip(), item, field) for part in value.split(",") if part.strip())
    except ValueError:
        raise RetrofitError(f"sparse method parameter {field}={value!r} is invalid: expected {annotation.__name__}") from None
    return value


def method_fields(cls: type[SparseMethod]) -> dict[str, Any]:
    """name -> resolved type annotation of the dataclass fields of a method."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build_method(name: str, budget: int | str, **params: Any) -> SparseMethod:
    """Construct a registered method; string values (from the CLI) are converted by the dataclass field types."""
    cls = METHODS.get(name)
    fields = method_fields(cls)
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise RetrofitError(
            f"unknown parameter {unknown[0]!r} for sparse method {name!r}; it takes: {', '.join(sorted(fields))}")
    values = {key: _coerce(value, fields[key], key) for key, value in params.items()}
    values["budget"] = _coerce(budget, int, "budget")
    return cls(**values)


def parse_sparse_args(args: list[str] | tuple[str, ...], method: str | None = None) -> dict[str, Any]:
    """Parse CLI ``k=v`` strings into a dict; with ``method`` the values are typed by its dataclass fields.

    >>> parse_sparse_args(["page_size=16", "dense_layers=0,1"], method="quest")
    {'page_size': 16, 'dense_layers': (0, 1)}
    """
    parsed: dict[str, Any] = {}
    for item in args:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise RetrofitError(f"--sparse-arg {item!r} is not of the form key=value")
        parsed[key] = value.strip()
    if method is not None:
        fields = method_fields(METHODS.get(method))
        for key in parsed:
            if key not in fields:
                raise RetrofitError(
                    f"unknown parameter {key!r} for sparse method {method!r}; it takes: {', '.join(sorted(fields))}")
        parsed = {key: _coerce(value, fields[key], key) for key, value in parsed.items()}
    return parsed
