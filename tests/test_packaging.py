"""The install maps the prescribed folders under `retrofit.*`; every package folder must be listed, none left out."""
from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FOLDER_OF = {"retrofit": "retrofit", "kernels": "retrofit.kernels"}


def _package_folders() -> set[str]:
    names = set()
    for top, prefix in FOLDER_OF.items():
        for init in (REPO / top).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / top)
            names.add(".".join([prefix, *relative.parts]))
    return names


def test_every_package_folder_is_installed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = _package_folders() - listed
    assert not missing, f"add to pyproject.toml [tool.setuptools] packages: {sorted(missing)}"


def test_no_generic_top_level_modules_are_importable():
    # transformers probes for Hugging Face's `kernels` package; ours must never be found under that name.
    assert importlib.util.find_spec("kernels") is None
    assert importlib.util.find_spec("cli") is None
    assert importlib.util.find_spec("retrofit.kernels") is not None
