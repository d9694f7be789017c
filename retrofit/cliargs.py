"""Values as users type them on the command line: token counts (``1k,4096``), ``key=value`` pairs, and strings
turned into the types a dataclass field declares. The one parser every verb uses."""
from __future__ import annotations

import re
import types
import typing
from typing import Any, Iterable

from retrofit.errors import RetrofitError

_NEXT_PAIR = re.compile(r",(?=\s*[A-Za-z_][\w-]*\s*=)")


def parse_lengths(text: str, option: str) -> tuple[int, ...]:
    """``"1k,4096,32K"`` -> ``(1024, 4096, 32768)``; anything else is a one-line user error naming ``option``."""
    lengths = []
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", part)
        if not match:
            raise RetrofitError(f"{option}: expected comma-separated token counts like 1k,4096, got {text!r}")
        value = int(match.group(1)) * (1024 if match.group(2) else 1)
        if value <= 0:
            raise RetrofitError(f"{option}: lengths must be positive, got {part.strip()!r}")
        lengths.append(value)
    return tuple(lengths)


def split_pairs(text: str) -> list[str]:
    """``"budget=256,dense_layers=0,1,page_size=4"`` -> ``["budget=256", "dense_layers=0,1", "page_size=4"]``: a comma
    starts a new pair only where a ``key=`` follows, so values may hold commas."""
    return [part for part in _NEXT_PAIR.split(text) if part.strip()]


def parse_pairs(items: Iterable[str], option: str) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{k: v}`` (strings; keys stripped, ``-`` read as ``_``); a malformed item is a one-line
    user error naming ``option``."""
    parsed: dict[str, str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise RetrofitError(f"{option} {item!r} is not of the form key=value")
        parsed[key] = value.strip()
    return parsed


def coerce(value: Any, annotation: Any, field: str, what: str = "parameter") -> Any:
    """A command-line string -> the type ``annotation`` declares (int, float, bool, tuples of them, optionals);
    non-strings pass through (lists become tuples). A value that does not fit is a one-line user error:
    ``"<what> <field>=<value> is invalid: expected <type>"``."""
    if not isinstance(value, str):
        return tuple(value) if isinstance(value, list) else value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null", "") and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            try:
                return coerce(value, option, field, what)
            except RetrofitError:
                continue
        raise RetrofitError(f"{what} {field}={value!r} is invalid: expected {annotation}")
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
            return tuple(coerce(part.strip(), item, field, what) for part in value.split(",") if part.strip())
    except ValueError:
        raise RetrofitError(f"{what} {field}={value!r} is invalid: expected {annotation.__name__}") from None
    return value


def given(context, name: str) -> bool:
    """Whether the click parameter ``name`` (its Python name) was set by the user (command line or environment),
    not left at its default: what tells an option that does nothing in this combination from one never touched."""
    from click.core import ParameterSource

    return context.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def refuse_without(context, requirements: dict[str, tuple[bool, str]]) -> None:
    """One-line refusal of options that do nothing here: ``{parameter: (it has what it needs, what it needs)}``;
    a parameter the user set whose need is missing raises ``"--option needs <what>"``."""
    for name, (satisfied, needed) in requirements.items():
        if given(context, name) and not satisfied:
            option = next(p.opts[0] for p in context.command.params if p.name == name)
            raise RetrofitError(f"{option} needs {needed}")
