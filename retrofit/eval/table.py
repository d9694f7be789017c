"""The Markdown table `retrofit eval` prints: tasks x metrics as rows (with each task's item count), variants as
columns (dense first); each value with its uncertainty, each variant's value with its paired delta to dense and that
delta's 95% interval, marked ``*`` when the interval excludes zero; a row of tokens/s with the speed ratio; under a
sparse prefill, the share of the causal key blocks each task's prefill computed.

Fractions (``acc``, ``acc_norm``, ``score``, ``partial``, ``score_sd``, ``agree``) are shown in percent, ``ppl``
and token counts (``agree_prefix``) as they are. A cell
that equals dense by construction (a sparse variant on a task scored by forward passes alone) reads "= dense (by
construction)" instead of a delta of 0 when every delta there is exactly 0, as it must be; otherwise its numbers are
shown with "≠ dense!" (the patch changed a forward pass it should not touch). tokens/s = tokens run through the model (non-pad prompt and generated
tokens) / seconds spent in the model calls, over all tasks the variant ran.
"""
from __future__ import annotations

import math

from retrofit.eval import stats
from retrofit.eval.batching import described
from retrofit.eval.outcome import FRACTION_METRICS, TOKEN_METRICS, is_primary
from retrofit.eval.runner import EvalReport

LEGEND = ("value ± stderr; [low, high] = 95% interval (ppl: bootstrap over windows, score: Wilson); "
          "Δ = paired difference to the first column on the same items, [95% interval]; * = the interval excludes 0")
DENSE_BY_CONSTRUCTION = "= dense (by construction)"
BROKEN_CONSTRUCTION = " ≠ dense!"


def shown_value(metric: str, value: float) -> float:
    return 100.0 * value if metric in FRACTION_METRICS else value


def metric_label(task: str, metric: str) -> str:
    if metric in FRACTION_METRICS:
        return f"{task} {metric} (%)"
    return f"{task} {metric} (tokens)" if metric in TOKEN_METRICS else f"{task} {metric}"


def _format(metric: str, value: float | None, signed: bool = False) -> str:
    if value is None or math.isnan(value):
        return "nan"
    shown = shown_value(metric, value)
    digits = 2 if metric in FRACTION_METRICS else 1 if metric in TOKEN_METRICS else 3
    if abs(shown) >= 1000:
        digits = 1
    return f"{shown:+.{digits}f}" if signed else f"{shown:.{digits}f}"


def value_cell(metric: str, entries: dict[str, float]) -> str:
    """``61.50 ± 3.45``, or ``23.940 [23.1, 24.9]`` where an interval other than +-1.96 stderr is recorded."""
    text = _format(metric, entries[metric])
    if f"{metric}_ci95_low" in entries:
        low, high = entries[f"{metric}_ci95_low"], entries[f"{metric}_ci95_high"]
        return f"{text} [{_format(metric, low)}, {_format(metric, high)}]"
    if f"{metric}_stderr" in entries:
        return f"{text} ± {_format(metric, entries[f'{metric}_stderr'])}"
    return text


def delta_cell(metric: str, entries: dict[str, float]) -> str:
    """``Δ -1.00 [-2.60, +0.60]``, with `` *`` when the paired interval excludes zero; a bare delta without one."""
    delta = entries.get(f"{metric}_delta")
    if delta is None:
        return ""
    text = f"Δ {_format(metric, delta, signed=True)}"
    low, high = entries.get(f"{metric}_delta_ci95_low"), entries.get(f"{metric}_delta_ci95_high")
    if low is None or high is None:
        return text
    marker = " *" if stats.excludes_zero(low, high) else ""
    return f"{text} [{_format(metric, low, signed=True)}, {_format(metric, high, signed=True)}]{marker}"


def _all_deltas_zero(entries: dict[str, float]) -> bool:
    return all(value == 0 for name, value in entries.items() if name.endswith("_delta"))


def _task_label(task: str, metric: str, entries: dict[str, float]) -> str:
    label = metric_label(task, metric)
    return f"{label}, n={int(entries['n'])}" if "n" in entries else label


def markdown_table(report: EvalReport) -> str:
    """Markdown text of the report: a one-line legend, then the table (header, one row per task/metric, tokens/s)."""
    variants = report.variants
    dense_results = report.results[variants[0]]
    # the first column is the model as loaded: "dense" unless MODEL is itself a hybrid checkpoint
    header = [report.config.get("model_kind", "dense"), *variants[1:]]
    lines = [LEGEND, "", "| task / metric | " + " | ".join(header) + " |", "|---|" + "---:|" * len(variants)]
    for task, entries in dense_results.items():
        for metric in filter(is_primary, entries):
            cells = [value_cell(metric, entries)]
            for variant in variants[1:]:
                variant_entries = report.results[variant].get(task, {})
                if metric not in variant_entries:
                    cells.append("—")
                    continue
                by_construction = task in report.dense_by_construction.get(variant, [])
                if by_construction and _all_deltas_zero(variant_entries):
                    cells.append(DENSE_BY_CONSTRUCTION)
                    continue
                delta = delta_cell(metric, variant_entries)
                cells.append(value_cell(metric, variant_entries) + (f" ({delta})" if delta else "")
                             + (BROKEN_CONSTRUCTION if by_construction else ""))
            lines.append(f"| {_task_label(task, metric, entries)} | " + " | ".join(cells) + " |")
    dense_speed = report.throughput[variants[0]]["tokens_per_s"]
    speed_cells = [f"{dense_speed:.1f}"]
    for variant in variants[1:]:
        speed = report.throughput[variant]["tokens_per_s"]
        speed_cells.append("- (no task of its own: = dense)" if math.isnan(speed)
                           else f"{speed:.1f} ({speed / dense_speed:.2f}x)")
    lines.append("| tokens/s | " + " | ".join(speed_cells) + " |")
    if report.blocks_computed:
        lines.append("| sparse prefill: blocks computed (%) | " + " | ".join(
            ", ".join(f"{task} {100 * share:.1f}" for task, share in report.blocks_computed[variant].items())
            if variant in report.blocks_computed else "-" for variant in variants) + " |")
    if report.batch_auto:
        lines.append("| batch size (auto) | " + " | ".join(described(report.batch_sizes.get(variant, {})) or "-"
                                                           for variant in variants) + " |")  # -: ran no task
    return "\n".join(lines)
