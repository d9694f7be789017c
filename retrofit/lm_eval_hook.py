"""The one line of lm-evaluation-harness that ``import retrofit`` runs: register the lm-eval model name ``retrofit``.

It is a lazy placeholder (``"retrofit.harness.model:RetrofitLM"``) in lm-eval's model registry, which lm-eval
imports on first use, so ``import retrofit`` imports only ``lm_eval.api.registry`` (a few milliseconds), never
lm-eval's model code, Accelerate or ``datasets``; without lm-eval it does nothing. lm-eval 0.4.x discovers no
models through entry points, hence this hook. It lives outside :mod:`retrofit.harness` because every stage imports
``retrofit`` itself, and the harness sits above them all.
"""
from __future__ import annotations

import importlib.util

MODEL_NAME = "retrofit"
MODEL_TARGET = "retrofit.harness.model:RetrofitLM"


def register() -> bool:
    """Register the lm-eval model ``retrofit`` as a lazy placeholder; False when lm-eval is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        return False
    try:
        from lm_eval.api.registry import model_registry
    except ImportError:  # an lm-eval without the 0.4.x registry: `retrofit lm-eval` says so when asked for
        return False
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)
    return True
