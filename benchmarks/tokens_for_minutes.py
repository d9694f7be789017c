"""Size a recipe's token budget to a time budget, from step times measured on the machine that will convert.

A conversion's time is its steps' time plus what does not depend on the budget (loading, tokenizing, the layer
scorer, saving; a resumed part loads again). ``benchmarks/distill_step.py --json`` measures milliseconds per step of
stage 1 and of stage 2 at each window length for a recipe's setting; this script walks the recipe's plan
(``retrofit.convert.plan.Plan``: stage-1 steps, then each stage-2 phase's steps) for budgets in whole millions of
tokens and keeps the largest whose predicted minutes fit, then writes the recipe with that budget (temp file, then
rename) and prints the plan and the prediction.

    python benchmarks/distill_step.py --device cuda --random --batch-size 16 --grad-accum 1 \\
        --layers 3-6,9,11-13,16,24-29 --json STEPS.json
    python benchmarks/tokens_for_minutes.py --steps STEPS.json --recipe recipes/smollm2-135m/kda-15of30-copyrank.yaml \\
        --minutes 18.5 --fixed-seconds 115 --out SIZED.yaml

On 2026-12-04 the step times of ``distill_step.py`` ran 10% over those of the conversion that followed (stage 1 107
against 95 ms, stage 2 232 against 211 ms averaged over its windows), so the prediction errs long.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrofit.atomic import write_text  # noqa: E402
from retrofit.convert.recipe import find_recipe, load_recipe  # noqa: E402
from retrofit.convert.plan import DistillConfig, Plan  # noqa: E402
from retrofit.errors import RetrofitError  # noqa: E402

MILLION = 1_000_000


def step_seconds(rows: list[dict]) -> tuple[float, dict[int, float]]:
    """distill_step.py's rows -> (stage-1 seconds per step, {stage-2 window length: seconds per step})."""
    stage1 = [row["ms_per_step"] / 1e3 for row in rows if row["stage"] == "stage 1"]
    stage2 = {int(row["window"]): row["ms_per_step"] / 1e3 for row in rows if row["stage"] == "stage 2"}
    if len(stage1) != 1 or not stage2:
        raise RetrofitError("the step times need one stage-1 row and at least one stage-2 row (distill_step.py --json)")
    return stage1[0], stage2


def read_rows(path: str) -> list[dict]:
    """The rows of a ``distill_step.py --json`` file."""
    try:
        return json.loads(Path(path).read_text())["rows"]
    except OSError as err:
        raise RetrofitError(f"--steps {path}: {err.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise RetrofitError(f"--steps {path}: not the JSON of distill_step.py --json") from None


def predicted_seconds(config: DistillConfig, stage1: float, stage2: dict[int, float], fixed: float) -> float:
    """Seconds a conversion with ``config`` takes: its plan's steps at the measured times, plus ``fixed``."""
    plan = Plan.from_config(config)
    missing = sorted({phase.seq_len for phase in plan.phases if phase.steps} - set(stage2))
    if missing:
        raise RetrofitError(f"no stage-2 step time for windows of {', '.join(map(str, missing))} tokens")
    return fixed + plan.stage1_steps * stage1 + sum(phase.steps * stage2[phase.seq_len] for phase in plan.phases)


def with_tokens(recipe_text: str, tokens: int) -> str:
    """The recipe's text with its ``tokens:`` line set to ``tokens`` (comments and order kept), or with one added
    where the recipe takes its budget from its base."""
    sized, count = re.subn(r"(?m)^tokens:.*$", f"tokens: {tokens}", recipe_text)
    if count == 0:
        return recipe_text.rstrip("\n") + f"\ntokens: {tokens}\n"
    if count > 1:
        raise RetrofitError("the recipe has more than one top-level 'tokens:' line")
    return sized


def with_base_found_from(recipe_text: str, recipe: Path, out: Path) -> str:
    """The recipe's text with its ``base:`` (if any) naming the same recipe when read from ``out``'s folder: a base
    given relative to the recipe's folder becomes an absolute path when the sized recipe is written elsewhere."""
    found = re.search(r"(?m)^base:[ \t]*['\"]?([^'\"\s]+)['\"]?[ \t]*$", recipe_text)
    if found is None:
        return recipe_text
    meant = find_recipe(found.group(1), relative_to=recipe.parent).resolve()
    try:
        if find_recipe(found.group(1), relative_to=out.parent).resolve() == meant:
            return recipe_text
    except RetrofitError:
        pass
    return recipe_text[:found.start()] + f"base: {meant}" + recipe_text[found.end():]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", required=True, help="distill_step.py --json output")
    parser.add_argument("--recipe", required=True, help="the recipe YAML to size")
    parser.add_argument("--minutes", type=float, required=True, help="the conversion's whole time budget")
    parser.add_argument("--fixed-seconds", type=float, required=True,
                        help="seconds that do not depend on the budget (loading, scoring, saving, resumed parts)")
    parser.add_argument("--out", required=True, help="where to write the sized recipe")
    args = parser.parse_args()
    try:
        stage1, stage2 = step_seconds(read_rows(args.steps))
        if not Path(args.recipe).is_file():  # its text is rewritten: a file, not a shipped name
            raise RetrofitError(f"--recipe {args.recipe}: not a file (give the YAML's path)")
        recipe = load_recipe(args.recipe)
        settings = {key: value for key, value in recipe.items() if key in DistillConfig.field_names()}
        budget = args.minutes * 60
        tokens = 0
        while predicted_seconds(DistillConfig(**{**settings, "tokens": tokens + MILLION}), stage1, stage2,
                                args.fixed_seconds) <= budget:
            tokens += MILLION
        if tokens == 0:
            raise RetrofitError(f"not even {MILLION:,} tokens fit {args.minutes} minutes at these step times")
        config = DistillConfig(**{**settings, "tokens": tokens})
        text = with_base_found_from(Path(args.recipe).read_text(), Path(args.recipe), Path(args.out))
        write_text(args.out, with_tokens(text, tokens))
    except RetrofitError as err:
        print(f"tokens_for_minutes.py: error: {err}", file=sys.stderr)
        raise SystemExit(2)
    plan = Plan.from_config(config)
    phases = ", ".join(f"{phase.steps} at {phase.seq_len}" for phase in plan.phases)
    print(f"tokens: {tokens} ({plan.stage1_steps} stage-1 steps at {stage1 * 1e3:.1f} ms; stage 2: {phases}; "
          f"predicted {predicted_seconds(config, stage1, stage2, args.fixed_seconds) / 60:.1f} min of "
          f"{args.minutes}) -> {args.out}")


if __name__ == "__main__":
    main()
