"""A conversion's loss against its optimizer steps: stage 1 (layer alignment) then stage 2 (logit distillation) on
one axis, a line per conversion, the start of stage 2 marked. Draws the step losses a conversion records
(``Distiller.history``, the JSON of ``benchmarks/convert_loss_curve.py``, or the losses its progress bars logged).
Needs matplotlib (the ``test`` extra)."""
from __future__ import annotations

from pathlib import Path

from retrofit.errors import RetrofitError
from retrofit.plotting import pyplot, save_figure

StageLosses = dict[str, list[tuple[int, float]]]  # "stage1"/"stage2": (step of that stage from 1, loss)


def loss_series(runs: dict[str, StageLosses]) -> dict[str, dict[str, list[float]]]:
    """The lines to draw: for each run its steps counted through both stages (stage 2's step 1 follows stage 1's
    last step), their losses, and ``stage2_from``, the first step of stage 2 on that axis."""
    series = {}
    for label, stages in runs.items():
        first, second = sorted(stages.get("stage1", [])), sorted(stages.get("stage2", []))
        if not first and not second:
            raise RetrofitError(f"--plot: {label} holds no step loss")
        offset = first[-1][0] if first else 0
        series[label] = {"step": [step for step, _ in first] + [offset + step for step, _ in second],
                         "loss": [loss for _, loss in first] + [loss for _, loss in second],
                         "stage2_from": [offset + 1]}
    return series


def save_loss_plot(runs: dict[str, StageLosses], path: Path, title: str | None = None) -> dict[str, dict[str, list]]:
    """Draw the step losses of ``runs`` (log-scale loss against step, the start of stage 2 marked) and write the PNG
    to ``path`` atomically; returns the series drawn (:func:`loss_series`)."""
    plt = pyplot()
    series = loss_series(runs)
    figure, axis = plt.subplots(figsize=(7.5, 4))
    for index, (label, line) in enumerate(series.items()):
        axis.plot(line["step"], line["loss"], color=f"C{index % 10}", linewidth=1, label=label)
    for boundary in sorted({line["stage2_from"][0] for line in series.values()}):
        axis.axvline(boundary, color="grey", linestyle="--", linewidth=1)
        axis.annotate("stage 1: align layers", (boundary, 1), xycoords=("data", "axes fraction"),
                      xytext=(-4, -12), textcoords="offset points", ha="right", fontsize=8, color="grey")
        axis.annotate("stage 2: distill logits", (boundary, 1), xycoords=("data", "axes fraction"),
                      xytext=(4, -12), textcoords="offset points", ha="left", fontsize=8, color="grey")
    axis.set_yscale("log")
    axis.set(xlabel="optimizer step", ylabel="loss (stage 1: relative MSE, stage 2: KL)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="upper right")
    if title:
        axis.set_title(title, fontsize=10)
    save_figure(figure, path, dpi=90)
    return series
