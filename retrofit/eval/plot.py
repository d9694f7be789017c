"""``--plot OUT.png``: one panel per synthetic task (score vs context length, a line per variant) and one panel
per other task/metric (a bar per variant, with the 95% interval as an error bar where one is recorded). Needs matplotlib (the ``test`` extra)."""
from __future__ import annotations

import math
from pathlib import Path

from retrofit.eval.runner import EvalReport
from retrofit.eval.outcome import is_primary
from retrofit.eval.stats import Z_95
from retrofit.eval.table import metric_label, shown_value
from retrofit.plotting import pyplot, save_figure


def _error_bar(metric: str, entries: dict[str, float]) -> tuple[float, float]:
    """(below, above) the value: the recorded 95% interval, else +-1.96 stderr, else none."""
    value = entries[metric]
    if f"{metric}_ci95_low" in entries:
        low, high = entries[f"{metric}_ci95_low"], entries[f"{metric}_ci95_high"]
    elif f"{metric}_stderr" in entries:
        low, high = value - Z_95 * entries[f"{metric}_stderr"], value + Z_95 * entries[f"{metric}_stderr"]
    else:
        return 0.0, 0.0
    center = shown_value(metric, value)
    below, above = center - shown_value(metric, low), shown_value(metric, high) - center
    return (0.0, 0.0) if math.isnan(below) or math.isnan(above) else (below, above)


def save_plot(report: EvalReport, path: Path) -> None:
    """Draw the report and write it atomically to ``path`` (PNG)."""
    plt = pyplot()
    variants = report.variants
    dense_results = report.results[variants[0]]
    synthetic: dict[str, list[tuple[int, str]]] = {}
    panels: list[tuple[str, str]] = []
    for task, metrics in dense_results.items():
        name, at, length = task.partition("@")
        if at and length.isdigit():
            synthetic.setdefault(name, []).append((int(length), task))
        else:
            panels += [(task, metric) for metric in metrics if is_primary(metric)]
    count = len(synthetic) + len(panels)
    columns = min(3, count)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    flat = [axis for row in axes for axis in row]
    for axis, (name, entries) in zip(flat, synthetic.items()):
        entries.sort()
        for variant in variants:
            axis.plot([length for length, _ in entries],
                      [shown_value("score", report.results[variant][task]["score"]) for _, task in entries],
                      marker="o", label=variant)
        axis.set_xscale("log", base=2)
        axis.set(title=name, xlabel="context length (tokens)", ylabel="score (%)", ylim=(-5, 105))
        axis.legend(fontsize=7)
    for axis, (task, metric) in zip(flat[len(synthetic):], panels):
        cells = [report.results[variant][task] for variant in variants]
        values = [shown_value(metric, entries[metric]) for entries in cells]
        bars = [_error_bar(metric, entries) for entries in cells]
        axis.bar(range(len(variants)), values, yerr=[[b for b, _ in bars], [a for _, a in bars]], capsize=3,
                 color=[f"C{index}" for index in range(len(variants))])
        axis.set_xticks(range(len(variants)), variants, rotation=20, fontsize=7)
        axis.set_title(metric_label(task, metric))
    for axis in flat[count:]:
        axis.set_visible(False)
    save_figure(figure, path)
