"""The import rules of pyproject.toml ([tool.importlinter]) hold, and breaking one is caught.

`lint-imports` (import-linter) reads the contracts from pyproject.toml and the package from the working directory;
.ci/run runs it too. Here it runs on the repository and on a copy with one forbidden import added.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300)


def _copy_package(target: Path) -> Path:
    """retrofit/ with its kernels (the link resolved) under ``target``, as the linter reads it."""
    shutil.copytree(REPO / "retrofit", target / "retrofit", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_the_repository_keeps_every_import_rule():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, forbidden, contract", [
    ("load.py", "import retrofit.convert.pipeline", "Loading a model, and the hybrid model itself, need none of"),
    ("kernels/backend.py", "import retrofit.errors", "The kernels import nothing of retrofit above them"),
    ("sparse/methods/quest.py", "import retrofit.eval.tasks", "Sparse methods know nothing of evaluation"),
    ("layers/spec.py", "import retrofit.convert.init", "Layers know nothing of conversion"),
])
def test_a_forbidden_import_breaks_its_rule(tmp_path, module, forbidden, contract):
    root = _copy_package(tmp_path)
    path = root / "retrofit" / module
    path.write_text(path.read_text() + f"\n{forbidden}  # deliberately forbidden\n")
    result = _lint(root)
    assert result.returncode != 0
    broken = result.stdout[result.stdout.index("Broken contracts"):]
    assert contract in broken, result.stdout[-3000:]


def test_the_kernels_rule_names_every_other_part_of_retrofit():
    # a module added next to the others must be forbidden to the kernels too, or the rule silently stops covering it
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden = set(next(c for c in contracts if c.get("source_modules") == ["retrofit.kernels"])["forbidden_modules"])
    parts = {f"retrofit.{p.stem}" for p in (REPO / "retrofit").iterdir()
             if p.name != "kernels" and (p.suffix == ".py" and p.stem != "__init__" or (p / "__init__.py").is_file())}
    assert parts == forbidden
