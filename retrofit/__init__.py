"""retrofit: make long context cheap for pretrained dense causal LMs.

    model, tokenizer = retrofit.load("smollm2-135m")
    ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)   # static cache, sync-free steps
    with retrofit.sparse_decoding(model, method="quest", budget=1024):
        ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)   # or model.generate(...)
    with retrofit.sparse_prefill(model, method="xattention", threshold=0.9):      # block-sparse prefill
        ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)
"""
from retrofit.after_import import when_imported as _when_imported
from retrofit.errors import RetrofitError
from retrofit.load import load
from retrofit.lm_eval_hook import register as _register_harness_model


_MODELING_AUTO = "transformers.models.auto.modeling_auto"


def _register_hybrid_classes(auto_module) -> None:
    """Register the hybrid classes with transformers' Auto classes, once ``auto_module`` (its configuration or
    modeling Auto module) has been imported."""
    import sys

    if auto_module.__name__ != _MODELING_AUTO and _MODELING_AUTO in sys.modules:
        return  # transformers is importing its model Auto classes: registered once they are complete
    from retrofit.hybrid import register

    register()


# Hybrid checkpoints load through AutoConfig / AutoModelForCausalLM once retrofit is imported: registered when
# transformers imports its Auto classes (now, if it already has), so `import retrofit` imports neither transformers nor
# torch (`retrofit --help` starts in a fraction of a second).
_when_imported("transformers.models.auto.configuration_auto", _register_hybrid_classes)
_when_imported(_MODELING_AUTO, _register_hybrid_classes)
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
