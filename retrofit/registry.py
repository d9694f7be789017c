"""Name -> plugin registries with "did you mean" suggestions (sparse methods, eval tasks, variants, ...)."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

from retrofit.errors import RetrofitError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of plugins of one kind.

    >>> METHODS = Registry("sparse method")
    >>> @METHODS.register("quest")
    ... class Quest: ...
    >>> METHODS.get("qest")  # raises RetrofitError: unknown sparse method 'qest' (did you mean 'quest'?) ...
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise RetrofitError(self.unknown_message(name))
        return self._items[name]

    def unknown_message(self, name: str) -> str:
        close = difflib.get_close_matches(name, self._items, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; choose from: {', '.join(self.names())}"

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
