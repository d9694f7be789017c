"""retrofit.generate keeps the last call's static cache (and on CUDA its captured step) per model: a next call of
the same batch size and cache bucket loads its prompt into the same tensors and gives the tokens a fresh generation
gives; another shape, sampling, a sparse session or the model's deletion frees it.

Tokens are compared exactly: a reused generation runs the same operations on the same shapes as a fresh one, only on
tensors emptied in place."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import retrofit
from retrofit.generation import kept_generation, release
from retrofit.sparse import sparse_decoding
from test_generation import _ours
from test_sparse_decoding import PROMPTS, SHORTER_PROMPT, _inputs

OTHER_PROMPTS = ["Water boils at a temperature of", SHORTER_PROMPT]


def test_a_call_of_the_same_bucket_reuses_the_cache_and_gives_the_fresh_tokens(smollm2, one_cpu_thread):
    model, tokenizer = smollm2
    release(model)
    first, second = _inputs(tokenizer, PROMPTS), _inputs(tokenizer, OTHER_PROMPTS)
    assert first.input_ids.shape[1] != second.input_ids.shape[1]  # other prompt lengths, the same 256 bucket
    _ours(model, tokenizer, first, 24)
    kept = kept_generation(model)
    assert kept is not None and kept.generation.capacity == 256
    keys = kept.generation.cache.layers[0].keys.data_ptr()

    reused = _ours(model, tokenizer, second, 16)
    assert kept_generation(model).generation is kept.generation
    assert kept.generation.cache.layers[0].keys.data_ptr() == keys
    fresh = _ours(model, tokenizer, second, 16, keep_state=False)
    assert torch.equal(reused, fresh), (reused != fresh).sum()
    with torch.no_grad():
        reference = model.generate(**second, max_new_tokens=16, do_sample=False, top_p=None, top_k=None,
                                   pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(reused, reference), (reused != reference).sum()


def test_another_shape_sampling_or_a_sparse_session_frees_the_kept_state(smollm2, one_cpu_thread):
    model, tokenizer = smollm2
    release(model)
    _ours(model, tokenizer, _inputs(tokenizer, PROMPTS), 8)
    two_rows = kept_generation(model).generation
    _ours(model, tokenizer, _inputs(tokenizer, PROMPTS[:1]), 8)  # batch 1: another shape
    assert kept_generation(model).generation is not two_rows and kept_generation(model).generation.batch == 1
    _ours(model, tokenizer, _inputs(tokenizer, PROMPTS[:1]), 8, do_sample=True, seed=0)
    assert kept_generation(model) is None
    _ours(model, tokenizer, _inputs(tokenizer, PROMPTS[:1]), 8)
    with sparse_decoding(model, method="streaming", budget=64):
        _ours(model, tokenizer, _inputs(tokenizer, PROMPTS[:1]), 8)
    assert kept_generation(model) is None
    assert release(model) is False


def test_the_kept_state_does_not_keep_the_model_alive():
    from retrofit.bench.configs import build_random_model

    model = build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=2)
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    retrofit.generate(model, ids, max_new_tokens=4, pad_token_id=0)
    assert kept_generation(model) is not None
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_a_hybrid_reused_starts_from_empty_states(kind, smollm2, one_cpu_thread):
    """The linear layers' conv and recurrent states are zeroed in place: the second prompt's tokens equal a fresh
    generation's (states left from the first prompt would change them)."""
    from retrofit.convert.build import to_hybrid
    from retrofit.hybrid import HybridSection

    model, tokenizer = smollm2
    hybrid = to_hybrid(model, HybridSection(layers=[3, 17], layer_type=kind, base_model_type="llama"))
    _ours(hybrid, tokenizer, _inputs(tokenizer, PROMPTS), 12)
    reused = _ours(hybrid, tokenizer, _inputs(tokenizer, OTHER_PROMPTS), 12)
    assert kept_generation(hybrid) is not None
    fresh = _ours(hybrid, tokenizer, _inputs(tokenizer, OTHER_PROMPTS), 12, keep_state=False)
    assert torch.equal(reused, fresh), (reused != fresh).sum()


def test_an_evaluation_frees_each_variants_kept_state_before_the_next_variant_opens(smollm2, one_cpu_thread):
    """retrofit eval runs dense, then each variant: the engine state kept for a variant's model (its static cache)
    is freed when the variant ends, so no two variants' caches are alive at once (a variant that loads its own model,
    a hybrid, kept one of its own beside dense's)."""
    import contextlib

    from retrofit.eval.runner import run_eval
    from retrofit.eval.tasks import EvalSettings, build_jobs
    from retrofit.variants import Variant

    model, tokenizer = smollm2
    release(model)
    kept_when_opened = []

    @contextlib.contextmanager
    def opener(dense_model, _):
        kept_when_opened.append(kept_generation(dense_model))
        yield dense_model

    jobs = build_jobs(["passkey"], EvalSettings(context_lengths=(256,), limit=2))
    report = run_eval(model, tokenizer, jobs, [Variant("probe", opener)], batch_size=2)
    assert kept_when_opened == [None]  # dense's kept state was freed when dense ended
    assert kept_generation(model) is None  # and the probe's, when it ended
    assert report.results["probe"]["passkey@256"]["score"] == report.results["dense"]["passkey@256"]["score"]
