"""``retrofit bench --plot OUT.png``: decode tokens/s against context (log scale), a line per variant, engine and
batch size, beside the prefill seconds (the time to first token) against context. Draws the points of a run or of
a saved ``retrofit bench --json``. Needs matplotlib (the ``test`` extra)."""
from __future__ import annotations

import math
from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.plotting import pyplot, save_figure


def bench_series(points: list[dict]) -> dict[str, dict[str, list[float]]]:
    """The lines to draw from bench points (``BenchPoint.to_json()`` records): for each variant, engine and batch
    (the engine named only when the points hold several) its contexts in increasing order with the decode tokens/s
    and prefill seconds there. Points that failed or hold no decode time are left out; a point measured twice (files
    joined) is refused."""
    engines = {point.get("engine", "retrofit") for point in points}
    lines: dict[str, dict[int, tuple[float, float]]] = {}
    for point in points:
        tokens_per_s = point.get("decode_tokens_per_s")
        if point.get("error") or tokens_per_s is None or not math.isfinite(tokens_per_s):
            continue
        engine = f", {point.get('engine', 'retrofit')}" if len(engines) > 1 else ""
        label = f"{point['variant']}{engine}, batch {point['batch']}"
        line = lines.setdefault(label, {})
        if point["context"] in line:
            raise RetrofitError(f"--plot: {label} at context {point['context']} measured twice")
        line[point["context"]] = (tokens_per_s, point["prefill_s"])
    if not lines:
        raise RetrofitError("--plot: no bench point with a decode time to draw")
    return {label: {"context": sorted(by_context),
                    "decode_tokens_per_s": [by_context[context][0] for context in sorted(by_context)],
                    "prefill_s": [by_context[context][1] for context in sorted(by_context)]}
            for label, by_context in lines.items()}


def chart_title(config: dict) -> str:
    """The model, GPU (or device) and dtype of a bench run, from its ``config`` (as ``--json`` saves it)."""
    return f"{config['source']}, {config.get('gpu', config['device'])}, {config['dtype']}"


def save_bench_plot(points: list[dict], path: Path, title: str | None = None) -> dict[str, dict[str, list[float]]]:
    """Draw ``points`` (decode tokens/s and prefill seconds against context) and write the PNG to ``path``
    atomically; returns the series drawn (:func:`bench_series`)."""
    plt = pyplot()
    series = bench_series(points)
    figure, (decode_axis, prefill_axis) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.25 * math.ceil(len(series) / 4)))
    variants = list(dict.fromkeys(label.rsplit(", batch", 1)[0] for label in series))
    batches = sorted({label.rsplit("batch ", 1)[1] for label in series}, key=int)
    for label, line in series.items():
        color = f"C{variants.index(label.rsplit(', batch', 1)[0]) % 10}"
        style = ["-", "--", ":", "-."][batches.index(label.rsplit("batch ", 1)[1]) % 4]
        decode_axis.plot(line["context"], line["decode_tokens_per_s"], style, color=color, marker="o", label=label)
        prefill_axis.plot(line["context"], line["prefill_s"], style, color=color, marker="o", label=label)
    contexts = sorted({context for line in series.values() for context in line["context"]})
    for axis in (decode_axis, prefill_axis):
        axis.set_xscale("log", base=2)
        axis.set_xticks(contexts, [f"{context // 1024}k" if context % 1024 == 0 else str(context)
                                   for context in contexts])
        axis.minorticks_off()
        axis.set_xlabel("context (tokens)")
        axis.grid(alpha=0.3)
    decode_axis.set(ylabel="decode tokens/s (all sequences)", title="decode throughput")
    prefill_axis.set(ylabel="prefill s (time to first token)", title="prefill")
    for axis in (decode_axis, prefill_axis):
        axis.set_yscale("log")
    handles, labels = decode_axis.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=7)
    if title:
        figure.suptitle(title, fontsize=10)
    rows_of_legend = math.ceil(len(labels) / 4)
    save_figure(figure, path, dpi=90, rect=(0, 0.05 * rows_of_legend, 1, 1))
    return series
