"""retrofit: make long context cheap for pretrained dense causal LMs.

    model, tokenizer = retrofit.load("smollm2-135m")
    ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)   # static cache, sync-free steps
    with retrofit.sparse_decoding(model, method="quest", budget=1024):
        ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)   # or model.generate(...)
    with retrofit.sparse_prefill(model, method="xattention", threshold=0.9):      # block-sparse prefill
        ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)
"""
from retrofit.errors import RetrofitError
from retrofit.load import load

from retrofit.hybrid import register as _register_hybrid_models
from retrofit.lm_eval_hook import register as _register_harness_model

# Hybrid checkpoints load through AutoModelForCausalLM once retrofit is imported (configs only; no modeling code yet).
_register_hybrid_models()
# lm-evaluation-harness, when installed, knows the model name "retrofit" (a lazy placeholder: imports nothing heavy).
_register_harness_model()

__version__ = "0.1.0"
__all__ = ["load", "generate", "sparse_decoding", "sparse_prefill", "RetrofitError", "__version__"]


def __getattr__(name: str):
    # Imported on first use: `import retrofit` patches nothing.
    if name == "sparse_decoding":
        from retrofit.sparse import sparse_decoding

        return sparse_decoding
    if name == "sparse_prefill":
        from retrofit.sparse import sparse_prefill

        return sparse_prefill
    if name == "generate":
        from retrofit.generation import generate

        return generate
    raise AttributeError(f"module 'retrofit' has no attribute {name!r}")
