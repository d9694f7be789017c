"""The front door's references resolve: every relative link and every file path named in README.md, docs/,
BENCHMARKS.md and the recipe and history READMEs exists; every shipped recipe they run loads; and every citation
"History > AREA > DATE — TITLE" anywhere in the repository names an entry of benchmarks/history/. Text only: no
model, no torch (well under 2 s)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "benchmarks" / "history"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", HISTORY / "README.md", *DOCS,
         *sorted((ROOT / "recipes").glob("**/README.md"))]
AREAS = {"Linear-attention kernels": "linear-attention-kernels.md",
         "Sparse decoding: kernel speed": "sparse-decoding-kernel-speed.md",
         "Sparse decoding: accuracy": "sparse-decoding-accuracy.md", "Conversion": "conversion.md",
         "End-to-end generation": "end-to-end-generation.md", "Loading": "loading.md", "Evaluation": "evaluation.md",
         "Sparse prefill": "sparse-prefill.md"}
TOP_LEVEL = ("retrofit/", "kernels/", "benchmarks/", "recipes/", "tests/", "docs/", ".ci/", "cli.py", "pyproject.toml",
             "README.md", "BENCHMARKS.md")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PLACEHOLDER = re.compile(r"[A-Z]{3,}|[*{}<>]|\.\.\.")


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_pages_are_there():
    assert len(DOCS) >= 5, DOCS  # conversion, sparse decoding, evaluation, bench, extending
    assert all(path.is_file() for path in PAGES)


def test_the_front_pages_stay_short():
    """A front page, not a notebook: the README within 220 lines, BENCHMARKS.md's current figures within 250 (the
    history lies in benchmarks/history/), each area of the current figures under its own heading."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    current = lines[lines.index("## Current figures"):lines.index("## History")]
    assert len(current) <= 250, len(current)
    areas = [line[4:] for line in current if line.startswith("### ")]
    assert {"Conversion", "Conversion at 7-8B scale", "Architectures", "Long context (Qwen2.5-0.5B)",
            "Sparse prefill", "Hybrid levers", *AREAS} <= set(areas), areas


def _links(path: Path) -> list[str]:
    return [target for target in LINK.findall(path.read_text())
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def _paths(path: Path) -> list[str]:
    """Backticked repository paths: a word that starts with a top-level folder or file, no placeholder in it."""
    named = []
    for code in CODE.findall(path.read_text()):
        for word in code.split():
            word = word.rstrip(".,;:)").split("::")[0]
            if word.startswith(TOP_LEVEL) and not PLACEHOLDER.search(word):
                named.append(word)
    return named


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_exists(page: Path):
    missing = [target for target in _links(page) if not (page.parent / target.split("#")[0]).exists()]
    assert not missing, missing


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation but hyphens dropped, spaces hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_anchor_names_a_heading(page: Path):
    targets = [target.partition("#") for target in _links(page) if "#" in target]
    missing = [f"{path}#{anchor}" for path, _, anchor in targets
               if path.endswith(".md") and anchor not in _anchors(page.parent / path)]
    assert not missing, missing


def test_anchors_are_githubs():
    assert {"conversion-at-7-8b-scale", "sparse-decoding-accuracy", "long-context-qwen25-05b"} <= _anchors(
        ROOT / "BENCHMARKS.md")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_named_path_exists(page: Path):
    missing = [word for word in _paths(page) if not (ROOT / word).exists()]
    assert not missing, missing


def test_the_readme_names_paths_and_links():
    """The checks above see what they should: the README links the guides and names files."""
    links, paths = _links(ROOT / "README.md"), _paths(ROOT / "README.md")
    assert {"docs/conversion.md", "docs/sparse-decoding.md", "docs/evaluation.md"} <= set(links), links
    assert "retrofit/architecture/families.py" in paths, paths


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_recipe_run_on_a_page_loads(page: Path):
    from retrofit.convert.recipe import load_recipe

    named = {name.rstrip(".,;)") for name in re.findall(r"--recipe ([^\s`]+)", page.read_text())}
    for name in sorted(named):
        if not PLACEHOLDER.search(name) and name not in ("R.yaml",):
            assert load_recipe(name if not name.startswith("recipes/") else ROOT / name), name


def _entries(area_file: Path) -> list[str]:
    return [line[3:].strip() for line in area_file.read_text().splitlines() if line.startswith("## ")]


def _flat(text: str) -> str:
    """The text with comment markers at line starts dropped and every run of white space one space, so that a
    citation wrapped over comment lines reads as one line."""
    return " ".join(re.sub(r"^\s*(#|//|\*)+", "", line) for line in text.splitlines()).replace("  ", " ")


def test_every_history_citation_names_an_entry():
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    entries = {area: _entries(HISTORY / name) for area, name in AREAS.items()}
    cited, unresolved = 0, []
    for name in files:
        if name.startswith("benchmarks/results/") or not name.endswith((".py", ".md", ".yaml", ".sh")):
            continue
        text = " ".join(_flat((ROOT / name).read_text(errors="replace")).split())
        for match in re.finditer(r"History > ([A-Z][\w :-]+?) > (\d{4}-\d\d-\d\d — )", text):
            area, follows = match.group(1), text[match.start(2):]
            if not any(follows.startswith(entry) for entry in entries.get(area, [])):
                unresolved.append((name, area, follows[:100]))
            cited += 1
    assert not unresolved, unresolved
    assert cited >= 20, cited  # recipes, kernels' tuning comments, BENCHMARKS.md's sources
