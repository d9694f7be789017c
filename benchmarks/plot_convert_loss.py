"""Draw the loss curves of saved conversions: loss against optimizer step, stage 1 then stage 2, a line per file.
Reads a ``retrofit convert`` log (the losses its progress bars showed, one a step while they were read every step,
until 2026-12-02; one every 16 steps since) or the JSON of ``benchmarks/convert_loss_curve.py`` (every step).

    python benchmarks/plot_convert_loss.py benchmarks/results/2026-12-02/kda_mended/h200_convert_long_kda-8of30.log \\
        --label "KDA 8 of 30" --out docs/images/conversion-loss.png
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from retrofit.convert.plot import StageLosses, save_loss_plot
from retrofit.errors import RetrofitError

PROGRESS_LOSS = re.compile(r"stage ([12]): [^|\n]*\|[^|\n]*\|\s*(\d+)/\d+ \[[^\]\n]*?loss=([-+0-9.eE]+)")


def losses_from_log(path: Path) -> StageLosses:
    """The loss each stage's progress bar showed at each step count (the last shown there), from a convert log."""
    shown: dict[str, dict[int, float]] = {"stage1": {}, "stage2": {}}
    for stage, count, loss in PROGRESS_LOSS.findall(path.read_text(errors="replace")):
        shown[f"stage{stage}"][int(count)] = float(loss)
    if not shown["stage1"] and not shown["stage2"]:
        raise RetrofitError(f"{path}: no progress bar with a loss (a run with --quiet logs none)")
    return {stage: sorted(losses.items()) for stage, losses in shown.items()}


def losses_from_json(path: Path) -> StageLosses:
    """Every step's loss from ``benchmarks/convert_loss_curve.py --json`` (``stage1`` and ``stage2`` lists)."""
    saved = json.loads(path.read_text())
    return {stage: [(step, loss) for step, loss in enumerate(saved[stage], start=1)] for stage in ("stage1", "stage2")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="retrofit convert logs or convert_loss_curve.py JSON files")
    parser.add_argument("--label", action="append", default=[], help="a run's name in the legend (repeatable, "
                                                                     "in the order of the files; default: file name)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    if len(args.label) > len(args.runs):
        parser.error(f"{len(args.label)} --label for {len(args.runs)} files")
    labels = args.label + [path.stem for path in args.runs[len(args.label):]]
    runs = {label: losses_from_json(path) if path.suffix == ".json" else losses_from_log(path)
            for label, path in zip(labels, args.runs)}
    save_loss_plot(runs, args.out, title=args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
