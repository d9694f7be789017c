"""Console-script entry point: finds the click group defined in the top-level ``cli.py``.

A wheel installs ``cli.py`` as ``retrofit.commands.cli``. An editable install cannot map a lone top-level file
into the package (setuptools' editable finder maps folders only), so there it is loaded from beside ``retrofit/``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def cli_module() -> ModuleType:
    try:
        from retrofit.commands import cli
    except ModuleNotFoundError:
        name = "retrofit.commands.cli"
        if name in sys.modules:
            return sys.modules[name]
        source = Path(__file__).resolve().parents[1] / "cli.py"
        spec = importlib.util.spec_from_file_location(name, source)
        cli = importlib.util.module_from_spec(spec)
        sys.modules[name] = cli
        spec.loader.exec_module(cli)
    return cli


def main() -> None:
    cli_module().main()
