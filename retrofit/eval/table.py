"""The Markdown table `retrofit eval` prints: tasks x metrics as rows, variants as columns (dense first), each
value with its delta to dense, and a last row of tokens/s with the speed ratio to dense.

Accuracies (``acc``, ``acc_norm``; fractions in the JSON) are shown in percent; ``score``/``partial`` of the
synthetic tasks are already percentages; ``ppl`` is shown as is. tokens/s = tokens run through the model
(non-pad prompt and generated tokens) / seconds spent in the model calls, over all tasks of the variant.
"""
from __future__ import annotations

import math

from retrofit.eval.runner import EvalReport

PERCENT_METRICS = {"acc", "acc_norm"}


def shown_value(metric: str, value: float) -> float:
    return 100.0 * value if metric in PERCENT_METRICS else value


def metric_label(task: str, metric: str) -> str:
    return f"{task} {metric} (%)" if metric in PERCENT_METRICS else f"{task} {metric}"


def _format(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"


def markdown_table(report: EvalReport) -> str:
    """Markdown text of the report (one header, one row per task/metric, one tokens/s row)."""
    variants = report.variants
    dense_results = report.results[variants[0]]
    # the first column is the model as loaded: "dense" unless MODEL is itself a hybrid checkpoint
    header = [report.config.get("model_kind", "dense"), *variants[1:]]
    lines = ["| task / metric | " + " | ".join(header) + " |", "|---|" + "---:|" * len(variants)]
    for task, metrics in dense_results.items():
        for metric, dense_value in metrics.items():
            cells = [_format(shown_value(metric, dense_value))]
            for variant in variants[1:]:
                value = report.results[variant].get(task, {}).get(metric)
                if value is None:
                    cells.append("—")
                    continue
                delta = shown_value(metric, value) - shown_value(metric, dense_value)
                cells.append(f"{_format(shown_value(metric, value))} ({delta:+.3f})")
            lines.append(f"| {metric_label(task, metric)} | " + " | ".join(cells) + " |")
    dense_speed = report.throughput[variants[0]]["tokens_per_s"]
    speed_cells = [f"{dense_speed:.1f}"]
    for variant in variants[1:]:
        speed = report.throughput[variant]["tokens_per_s"]
        speed_cells.append(f"{speed:.1f} ({speed / dense_speed:.2f}x)")
    lines.append("| tokens/s | " + " | ".join(speed_cells) + " |")
    return "\n".join(lines)
