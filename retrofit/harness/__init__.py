"""retrofit inside lm-evaluation-harness (the ``harness`` extra: ``pip install "retrofit[harness]"``).

- ``import retrofit`` registers the lm-eval model name ``retrofit`` (:class:`retrofit.harness.model.RetrofitLM`)
  when lm-eval is installed, so ``lm_eval.simple_evaluate(model="retrofit",
  model_args="pretrained=smollm2-135m,sparse=quest,budget=1024,page_size=16")`` works, as does
  ``model_args="pretrained=DIR"`` for a hybrid checkpoint;
- ``retrofit lm-eval ...`` runs lm-eval's own command line with that model registered and the tasks of
  :data:`TASKS_DIR` included (``retrofit_piqa``, ``retrofit_arc_easy``, ``retrofit_hellaswag``,
  ``retrofit_lambada``: the files of ``--metadata data_dir=DIR``, read by the loaders of ``retrofit eval``, so both
  harnesses score the same items);
- ``retrofit lm-eval-task`` writes a long-context synthetic task (passkey, niah_single, ...) as a JSONL file and an
  lm-eval task YAML (``dataset_path: json``), for ``--include_path``.

The registration itself is :mod:`retrofit.lm_eval_hook` (cheap: a lazy placeholder in lm-eval's registry).
"""
from __future__ import annotations

from pathlib import Path

from retrofit.lm_eval_hook import MODEL_NAME, register

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
"""The lm-eval task YAMLs shipped with retrofit (pass as ``include_path``; ``retrofit lm-eval`` adds it)."""

__all__ = ["MODEL_NAME", "TASKS_DIR", "register"]
