"""Run a function right after a module is first imported, without importing it.

``import retrofit`` must make hybrid checkpoints loadable through transformers' Auto classes, but importing
transformers' Auto classes (and, with them, torch) costs seconds that ``retrofit --help`` and every command that
never builds a model would pay. :func:`when_imported` defers such a registration to the moment the registry it writes
into is imported by anyone; a module already imported gets the call at once.
"""
from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Callable

Callback = Callable[[ModuleType], None]


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once the module ``name`` has been executed: now if it already has, else right after
    its first import completes (the import then returns the module as usual)."""
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        callback(module)
        return
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImportFinder) and finder.name == name:
            finder.callbacks.append(callback)
            return
    sys.meta_path.insert(0, _AfterImportFinder(name, [callback]))


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``name`` it asks the finders after it and wraps the loader they give."""

    def __init__(self, name: str, callbacks: list[Callback]):
        self.name, self.callbacks = name, callbacks

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        sys.meta_path.remove(self)  # one import, one call
        spec.loader = _CallingAfterExec(spec.loader, self.callbacks)
        return spec


class _CallingAfterExec(importlib.abc.Loader):
    """The original loader, whose ``exec_module`` calls the callbacks once the module body has run."""

    def __init__(self, loader, callbacks: list[Callback]):
        self.loader, self.callbacks = loader, callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for callback in self.callbacks:
            callback(module)

    def __getattr__(self, name: str):  # get_source, is_package, get_resource_reader, ...: the original loader's
        return getattr(self.loader, name)
