"""Evaluation: perplexity, multiple choice, LAMBADA, RULER-style synthetic tasks; dense vs variants.

``retrofit eval`` is :mod:`retrofit.eval.command`; the pieces are usable on their own:

    from retrofit.eval import run_eval, build_jobs, EvalSettings
    report = run_eval(model, tokenizer, build_jobs(["piqa"], EvalSettings(data_dir=..., limit=200)), variants=[])
    report.results["dense"]["piqa"]   # {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n"}

A job returns a plain ``{metric: value}`` or a :class:`TaskOutcome` of per-item values (``MeanMetric``,
``PerplexityMetric``), which gives its metrics a stderr and each variant a paired delta (names:
``retrofit.eval.outcome``).
"""
from retrofit.eval.outcome import MeanMetric, PerplexityMetric, TaskOutcome
from retrofit.eval.runner import EvalReport, run_eval
from retrofit.eval.tasks import TASKS, EvalSettings, build_jobs
from retrofit.variants import VARIANT_KINDS, Variant

__all__ = ["EvalReport", "EvalSettings", "MeanMetric", "PerplexityMetric", "TASKS", "TaskOutcome", "VARIANT_KINDS",
           "Variant", "build_jobs", "run_eval"]
