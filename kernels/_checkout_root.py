"""This folder seen from a checkout's root, under the name of Hugging Face's ``kernels`` package.

``python -c``, ``python -m`` and ``torchrun -m`` run in the repository root put the root first on ``sys.path``, where
this folder is a top-level package named ``kernels``. Hugging Face's ``kernels`` (a dependency of transformers since
5.25) has that name, and transformers imports it at start-up when it is installed. retrofit itself reaches this folder
only as ``retrofit.kernels`` (installed under that name; in a checkout through the ``retrofit/kernels`` link), so the
top-level name is handed over to the installed package: importing ``kernels`` here gives Hugging Face's.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def installed_kernels_took_the_name(module_name: str) -> bool:
    """Called by this folder's ``__init__`` with its ``__name__``: when imported as the top-level ``kernels`` and
    Hugging Face's package is installed elsewhere on ``sys.path``, load that package in its place in ``sys.modules``
    (the import then returns it) and return True; otherwise False (as ``retrofit.kernels``, or with nothing
    installed: transformers then finds no ``kernels`` distribution and imports no such package)."""
    if module_name != "kernels":
        return False
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return False
    installed = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = installed
    spec.loader.exec_module(installed)
    return True
