"""Draw saved ``retrofit eval --json`` results (or conversion reports, ``OUT/report.json``) as ``retrofit eval
--plot`` draws a run: one panel per synthetic task (score against context length, a line per variant), one per
other task and metric (a bar per variant with its 95% interval). Several files join into one chart: dense from the
and every variant's tasks from each file, so reports of hybrids converted on different days, or one evaluation run
a context length at a time, sit side by side (dense's numbers must agree where files share a task).

    python benchmarks/plot_eval_json.py benchmarks/results/2026-12-04/h200_convert_report_kda-8of30-50m-b16.json \\
        benchmarks/results/2026-12-06/h100_convert_report_kda-15of30-copyrank.json --out docs/images/report.png
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.eval.outcome import FRACTION_METRICS
from retrofit.eval.plot import save_plot
from retrofit.eval.runner import EvalReport


def joined_report(paths: list[Path], tasks: list[str] | None = None, variants: list[str] | None = None) -> EvalReport:
    """One report from saved results, variants in order of first appearance, dense first. A variant's tasks from
    every file are joined (the same variant at other context lengths, from another file); a task twice for one
    variant is refused unless it is dense's with the same numbers. ``tasks`` keeps those tasks (a synthetic task by
    its name, e.g. ``passkey`` for ``passkey@2048``) in that order; ``variants`` keeps those variants (dense always)."""
    report = EvalReport()
    for path in paths:
        saved = json.loads(path.read_text())
        results = saved["results"] if "units" in saved else _as_fractions(saved["results"])
        if "dense" not in results:
            raise RetrofitError(f"{path}: no dense results to compare with")
        for variant in ["dense", *(name for name in results if name != "dense")]:
            joined = report.results.setdefault(variant, {})
            for task, cells in results[variant].items():
                if task in joined:
                    if variant != "dense":
                        raise RetrofitError(f"{path}: {variant} on {task} already comes from an earlier file")
                    _check_same_dense(task, joined[task], cells, path)
                joined[task] = cells
    if variants:
        unknown = sorted(set(variants) - set(report.results))
        if unknown:
            raise RetrofitError(f"--variants: {', '.join(unknown)} not in the results ({', '.join(report.results)})")
        report.results = {name: report.results[name] for name in ["dense", *variants] if name in report.results}
    if tasks:
        every = [task for cells in report.results.values() for task in cells]
        kept = list(dict.fromkeys(task for name in tasks for task in every if task.partition("@")[0] == name))
        if not kept:
            raise RetrofitError(f"--tasks {','.join(tasks)}: none of them is in the results")
        report.results = {variant: {task: cells[task] for task in kept if task in cells}
                          for variant, cells in report.results.items()}
    return report


def _as_fractions(results: dict) -> dict:
    """Results saved before the JSON named its units (before 2026-12-02) hold accuracies and scores in percent;
    the table and the plot read fractions."""
    def converted(metric: str, value):
        base = re.sub(r"(_delta)?(_stderr|_ci95_low|_ci95_high)?$", "", metric)  # acc_norm_delta_stderr: acc_norm
        return value / 100 if base in FRACTION_METRICS and isinstance(value, (int, float)) else value

    return {variant: {task: {metric: converted(metric, value) for metric, value in cells.items()}
                      for task, cells in tasks.items()} for variant, tasks in results.items()}


def _check_same_dense(task: str, first: dict, other: dict, path: Path) -> None:
    for metric in ("ppl", "acc", "score"):
        if metric in first and not math.isclose(first[metric], other[metric], rel_tol=1e-6):
            raise RetrofitError(f"{path}: dense {task} {metric} {other[metric]} differs from an earlier file's "
                                f"{first[metric]}: not the same evaluation")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="retrofit eval --json files or report.json files")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks to draw (default: all)")
    parser.add_argument("--variants", default=None, help="semicolon-separated variants to draw besides dense "
                        "(default: all)")
    args = parser.parse_args(argv)
    report = joined_report(args.results, args.tasks.split(",") if args.tasks else None,
                           args.variants.split(";") if args.variants else None)
    save_plot(report, args.out)
    print(f"{args.out}: {', '.join(report.variants)}")


if __name__ == "__main__":
    main()
