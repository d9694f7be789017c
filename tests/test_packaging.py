"""The install maps the prescribed folders under `retrofit.*`; every package folder must be listed, none left out."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
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
    # (`kernels`: the next test; the folder is on sys.path wherever the checkout's root is, e.g. an editable install)
    assert importlib.util.find_spec("cli") is None
    assert importlib.util.find_spec("retrofit.kernels") is not None


def test_from_the_checkouts_root_kernels_is_hugging_faces_and_transformers_starts():
    """``python -c`` in the repository root puts the root first on sys.path, where ``kernels/`` is a top-level
    package: importing it there hands the name to Hugging Face's installed package (transformers 5.25 imports names of
    it at start-up), while retrofit's kernels stay ``retrofit.kernels``."""
    code = ("import importlib.metadata, kernels, transformers.activations, retrofit.kernels; "
            "print(kernels.__file__); print(retrofit.kernels.causal_conv1d_update.__module__); "
            "print(importlib.metadata.version('kernels'))")
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    kernels_file, conv_module, _ = completed.stdout.split()
    assert Path(kernels_file).resolve() != (REPO / "kernels" / "__init__.py").resolve()  # Hugging Face's
    assert conv_module == "retrofit.kernels.conv.causal_conv1d"
