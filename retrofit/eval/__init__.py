"""Evaluation: perplexity, multiple choice, LAMBADA, RULER-style synthetic tasks; dense vs variants.

``retrofit eval`` is :mod:`retrofit.eval.command`; the pieces are usable on their own:

    from retrofit.eval import run_eval, build_jobs, EvalSettings
    report = run_eval(model, tokenizer, build_jobs(["piqa"], EvalSettings(data_dir=..., limit=200)), variants=[])
"""
from retrofit.eval.runner import EvalReport, run_eval
from retrofit.eval.tasks import TASKS, EvalSettings, build_jobs
from retrofit.variants import VARIANT_KINDS, Variant

__all__ = ["EvalReport", "EvalSettings", "TASKS", "VARIANT_KINDS", "Variant", "build_jobs", "run_eval"]
