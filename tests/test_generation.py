"""retrofit.generate on the real SmolLM2-135M: the same greedy tokens as transformers' model.generate for a dense
model, every sparse method at a budget covering the context, and converted hybrids (ragged batch of 2, 64 new
tokens); seeded sampling; chunked prefill.

Greedy tokens are compared exactly: with a budget covering the context every method reads every valid key, so the
engine computes the same softmax as dense up to fp32 rounding (a different summation order in the decode kernel's
PyTorch path), far below the logit gaps greedy decoding depends on on these prompts.
"""
from __future__ import annotations

import pytest
import torch

import retrofit
from retrofit.errors import RetrofitError
from retrofit.sparse import METHODS, SparseCache, SparseLayer, sparse_decoding
from test_sparse_decoding import EXACT, PROMPTS, _inputs, _params, seer_gates  # noqa: F401 (fixture)

NEW_TOKENS = 64


def _hf(model, tokenizer, inputs, max_new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None,
                              pad_token_id=tokenizer.pad_token_id)


def _ours(model, tokenizer, inputs, max_new_tokens=NEW_TOKENS, **options):
    return retrofit.generate(model, inputs.input_ids, inputs.attention_mask, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, **options)


@pytest.fixture(scope="module")
def dense_reference(smollm2, one_cpu_thread):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    return inputs, _hf(model, tokenizer, inputs)


def test_dense_greedy_tokens_equal_transformers(smollm2, dense_reference):
    model, tokenizer = smollm2
    inputs, reference = dense_reference
    assert inputs.attention_mask[0].sum() < inputs.attention_mask[1].sum()  # ragged, left padded
    tokens = _ours(model, tokenizer, inputs)
    assert tokens.shape == reference.shape  # the same stop: after the last row's end token, or 64 new tokens
    assert torch.equal(tokens, reference), (tokens != reference).sum()


@pytest.mark.parametrize("name", METHODS.names())
def test_sparse_budget_covering_context_gives_dense_tokens(name, smollm2, dense_reference, seer_gates):
    model, tokenizer = smollm2
    inputs, reference = dense_reference
    with sparse_decoding(model, method=name, budget=512, **_params(name, EXACT, seer_gates)) as session:
        tokens = _ours(model, tokenizer, inputs)
        cache = session.cache
    assert isinstance(cache, SparseCache) and cache.capacity == 256  # the engine's static cache (81 -> 256)
    steps = [layer.sparse_steps for layer in cache.layers if isinstance(layer, SparseLayer)]
    # every sparse layer ran the sparse kernel on every decode step (nothing fell back to dense)
    assert len(steps) == 30 and min(steps) == max(steps) == reference.shape[1] - inputs.input_ids.shape[1] - 1
    assert torch.equal(tokens, reference), (tokens != reference).sum()


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_hybrid_greedy_tokens_equal_transformers(kind, smollm2, one_cpu_thread):
    """A hybrid converted in memory (layers 3, 10, 17, 24 to GDN or KDA, undistilled): both paths run the same
    layers (chunk kernel for the prompt, recurrent steps after it), so greedy tokens agree."""
    from retrofit.convert.build import to_hybrid
    from retrofit.hybrid import HybridSection

    model, tokenizer = smollm2
    hybrid = to_hybrid(model, HybridSection(layers=[3, 10, 17, 24], layer_type=kind, base_model_type="llama"))
    inputs = _inputs(tokenizer)
    reference = _hf(hybrid, tokenizer, inputs)
    tokens = _ours(hybrid, tokenizer, inputs)
    assert torch.equal(tokens, reference), (tokens != reference).sum()


def test_seeded_sampling_is_reproducible(smollm2, dense_reference):
    model, tokenizer = smollm2
    inputs, reference = dense_reference
    first = _ours(model, tokenizer, inputs, 16, do_sample=True, temperature=0.8, top_p=0.95, seed=7)
    again = _ours(model, tokenizer, inputs, 16, do_sample=True, temperature=0.8, top_p=0.95, seed=7)
    other = _ours(model, tokenizer, inputs, 16, do_sample=True, temperature=0.8, top_p=0.95, seed=8)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)  # 32 tokens drawn at temperature 0.8: two seeds agreeing on all is ~0
    # a nucleus of one token is greedy decoding, whatever the seed
    nucleus = _ours(model, tokenizer, inputs, 16, do_sample=True, top_p=1e-6, seed=3)
    assert torch.equal(nucleus, reference[:, : nucleus.shape[1]])


def test_chunked_prefill_gives_the_same_tokens(smollm2, dense_reference):
    """Prefill in chunks of 8 tokens (3 chunks for the longer prompt, the first one all padding for the shorter)."""
    model, tokenizer = smollm2
    inputs, reference = dense_reference
    tokens = _ours(model, tokenizer, inputs, 16, prefill_chunk=8)
    assert torch.equal(tokens, reference[:, : tokens.shape[1]])


def test_streamer_gets_the_generated_text(smollm2):
    import io

    from retrofit.generation import stream_generate

    model, tokenizer = smollm2
    out = io.StringIO()
    produced = stream_generate(model, tokenizer, PROMPTS[1], chat=False, max_new_tokens=20, out=out)
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    expected = _hf(model, tokenizer, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 20)
    assert (produced.prompt_tokens, produced.new_tokens) == (ids.shape[1], expected.shape[1] - ids.shape[1])
    assert produced.prefill_seconds > 0 and produced.decode_seconds > 0
    assert out.getvalue() == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("options, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be a positive number"),
    ({"max_new_tokens": 8200}, "over the model's limit of 8192 positions"),
    ({"temperature": 0.7}, "temperature only apply to sampling"),
    ({"do_sample": True, "temperature": 0.0}, "sampling needs a temperature above 0"),
    ({"do_sample": True, "top_p": 1.5}, "top_p=1.5 is invalid"),
    ({"seed": 3}, "seed only apply to sampling"),
], ids=["no-tokens", "too-long", "temperature-greedy", "zero-temperature", "top-p", "seed-greedy"])
def test_bad_options_are_one_line_errors(smollm2, options, message):
    model, tokenizer = smollm2
    inputs = _inputs(tokenizer)
    options = {"max_new_tokens": 4, **options}
    with pytest.raises(RetrofitError, match=message):
        retrofit.generate(model, inputs.input_ids, inputs.attention_mask, **options)


def test_right_padding_is_refused(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="right")
    with pytest.raises(RetrofitError, match="must be left-padded"):
        retrofit.generate(model, inputs.input_ids, inputs.attention_mask, max_new_tokens=4)
