"""The registry of sparse methods by name, and building one from (possibly command-line string) parameters."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from retrofit.cliargs import coerce
from retrofit.errors import RetrofitError
from retrofit.registry import Registry
from retrofit.sparse.contract import SparseMethod

METHODS: Registry[type[SparseMethod]] = Registry("sparse method")
PARAMETER = "sparse method parameter"


def register(name: str):
    """Class decorator: register a SparseMethod subclass under ``name``."""

    def add(cls: type[SparseMethod]) -> type[SparseMethod]:
        cls.name = name
        return METHODS.register(name)(cls)

    return add


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
    values = {key: coerce(value, fields[key], key, PARAMETER) for key, value in params.items()}
    values["budget"] = coerce(budget, int, "budget", PARAMETER)
    return cls(**values)
