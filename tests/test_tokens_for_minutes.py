"""benchmarks/tokens_for_minutes.py: a recipe's token budget sized to a time budget from measured step times. The
arithmetic is checked against the recipe's own plan on the CPU (the step times are given, not measured)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from retrofit.convert.recipe import load_recipe
from retrofit.convert.plan import DistillConfig, Plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "tokens_for_minutes.py"
RECIPE = ROOT / "recipes" / "smollm2-135m" / "archive" / "kda-15of30-b16.yaml"
STEP_SECONDS = {"stage 1": {1024: 0.150}, "stage 2": {1024: 0.260, 4096: 0.300, 8192: 0.240}}


def _seconds(tokens: int, fixed: float) -> float:
    """The recipe's plan at ``tokens``, each step at STEP_SECONDS, plus ``fixed``: computed here step by step."""
    settings = {k: v for k, v in load_recipe(RECIPE).items() if k in DistillConfig.field_names()}
    plan = Plan.from_config(DistillConfig(**{**settings, "tokens": tokens}))
    return fixed + plan.stage1_steps * STEP_SECONDS["stage 1"][1024] + sum(
        phase.steps * STEP_SECONDS["stage 2"][phase.seq_len] for phase in plan.phases)


def _size(tmp_path: Path, minutes: float, fixed: float = 115.0) -> subprocess.CompletedProcess:
    rows = [{"stage": stage, "window": window, "ms_per_step": seconds * 1e3}
            for stage, by_window in STEP_SECONDS.items() for window, seconds in by_window.items()]
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"setting": "given", "rows": rows}))
    return subprocess.run([sys.executable, str(SCRIPT), "--steps", str(steps), "--recipe", str(RECIPE), "--minutes",
                           str(minutes), "--fixed-seconds", str(fixed), "--out", str(tmp_path / "sized.yaml")],
                          capture_output=True, text=True, timeout=120)


def test_the_largest_million_that_fits_and_the_recipe_otherwise_unchanged(tmp_path):
    result = _size(tmp_path, minutes=16.0)
    assert result.returncode == 0, result.stderr
    sized = yaml.safe_load((tmp_path / "sized.yaml").read_text())
    tokens = sized["tokens"]
    # whole millions: this budget fits 16 minutes, one million more does not
    assert tokens % 1_000_000 == 0 and _seconds(tokens, 115.0) <= 16 * 60 < _seconds(tokens + 1_000_000, 115.0)
    # a step of 16,384 tokens averages 0.2 x 0.150 + 0.8 x (0.7 x 0.260 + 0.18 x 0.300 + 0.12 x 0.240) = 0.242 s,
    # 14.8 s a million tokens: (16 x 60 - 115) / 14.8 = 57M
    assert 50_000_000 <= tokens <= 60_000_000
    assert {k: v for k, v in sized.items() if k != "tokens"} == {
        k: v for k, v in yaml.safe_load(RECIPE.read_text()).items() if k != "tokens"}
    assert (tmp_path / "sized.yaml").read_text().startswith(RECIPE.read_text().split("\n", 1)[0])  # comments kept
    assert f"tokens: {tokens} " in result.stdout and "predicted 16.0 min of 16.0" in result.stdout


def test_a_budget_nothing_fits_is_refused_in_one_line(tmp_path):
    result = _size(tmp_path, minutes=1.0)  # under the 115 fixed seconds alone
    assert result.returncode == 2 and not (tmp_path / "sized.yaml").exists()
    assert result.stderr.strip().splitlines() == [
        "tokens_for_minutes.py: error: not even 1,000,000 tokens fit 1.0 minutes at these step times"]


def test_missing_steps_and_a_recipe_name_are_refused_in_one_line(tmp_path):
    def size(steps: Path, recipe: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), "--steps", str(steps), "--recipe", recipe, "--minutes",
                               "16", "--fixed-seconds", "115", "--out", str(tmp_path / "sized.yaml")],
                              capture_output=True, text=True, timeout=120)

    missing = size(tmp_path / "none.json", str(RECIPE))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"tokens_for_minutes.py: error: --steps {tmp_path / 'none.json'}: No such file or directory"]
    (tmp_path / "other.json").write_text("{}")
    other = size(tmp_path / "other.json", str(RECIPE))
    assert other.returncode == 2 and other.stderr.strip().endswith("not the JSON of distill_step.py --json")
    assert _size(tmp_path, 16.0).returncode == 0  # writes steps.json beside, then a shipped name instead of a path:
    named = size(tmp_path / "steps.json", "smollm2-135m/kda-15of30-b16")
    assert named.returncode == 2 and named.stderr.strip().endswith("not a file (give the YAML's path)")


def test_a_recipe_on_a_base_beside_it_is_sized_into_another_folder(tmp_path):
    """A recipe without its own budget gets a ``tokens:`` line, and its base, named relative to its own folder, is
    still found from the folder the sized recipe is written to."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "parent.yaml").write_text(RECIPE.read_text())
    child = tmp_path / "mine" / "child.yaml"
    child.write_text("# on parent, half a stage 2 on 1K windows\nbase: parent\n"
                     "stage2_lengths: \"1024:0.5,4096:0.3,8192:0.2\"\n")
    assert _size(tmp_path, 1.0).returncode == 2  # writes steps.json; nothing fits a minute
    out = tmp_path / "elsewhere" / "sized.yaml"
    out.parent.mkdir()
    result = subprocess.run([sys.executable, str(SCRIPT), "--steps", str(tmp_path / "steps.json"), "--recipe",
                             str(child), "--minutes", "16", "--fixed-seconds", "115", "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    sized = load_recipe(out)
    assert sized == {**load_recipe(child), "tokens": sized["tokens"]}
    assert sized["tokens"] != load_recipe(child)["tokens"] and sized["tokens"] % 1_000_000 == 0
    assert f"base: {(tmp_path / 'mine' / 'parent.yaml').resolve()}" in out.read_text()
