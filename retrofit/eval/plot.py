"""``--plot OUT.png``: one panel per synthetic task (score vs context length, a line per variant) and one panel
per other task/metric (a bar per variant). Needs matplotlib (the ``test`` extra)."""
from __future__ import annotations

import math
from pathlib import Path

from retrofit.atomic import atomic_path
from retrofit.errors import RetrofitError
from retrofit.eval.runner import EvalReport
from retrofit.eval.table import metric_label, shown_value


def save_plot(report: EvalReport, path: Path) -> None:
    """Draw the report and write it atomically to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RetrofitError("--plot needs matplotlib (pip install matplotlib)") from None
    variants = report.variants
    dense_results = report.results[variants[0]]
    synthetic: dict[str, list[tuple[int, str]]] = {}
    panels: list[tuple[str, str]] = []
    for task, metrics in dense_results.items():
        name, at, length = task.partition("@")
        if at and length.isdigit():
            synthetic.setdefault(name, []).append((int(length), task))
        else:
            panels += [(task, metric) for metric in metrics]
    count = len(synthetic) + len(panels)
    columns = min(3, count)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    flat = [axis for row in axes for axis in row]
    for axis, (name, entries) in zip(flat, synthetic.items()):
        entries.sort()
        for variant in variants:
            axis.plot([length for length, _ in entries],
                      [report.results[variant][task]["score"] for _, task in entries], marker="o", label=variant)
        axis.set_xscale("log", base=2)
        axis.set(title=name, xlabel="context length (tokens)", ylabel="score (%)", ylim=(-5, 105))
        axis.legend(fontsize=7)
    for axis, (task, metric) in zip(flat[len(synthetic):], panels):
        values = [shown_value(metric, report.results[variant][task][metric]) for variant in variants]
        axis.bar(range(len(variants)), values, color=[f"C{index}" for index in range(len(variants))])
        axis.set_xticks(range(len(variants)), variants, rotation=20, fontsize=7)
        axis.set_title(metric_label(task, metric))
    for axis in flat[count:]:
        axis.set_visible(False)
    figure.tight_layout()
    try:
        with atomic_path(path) as temporary:
            figure.savefig(temporary, dpi=120, format="png")
    finally:
        plt.close(figure)
