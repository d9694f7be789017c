"""retrofit.generate gives transformers' tokens on every architecture row of the zoo (tests/architecture_zoo.py).

Per row: a tiny random model of the family (untied embeddings, random biases, sliding windows of 64 where the family
has them), a ragged batch of two prompts of 300 tokens (row 1 left-padded by 37), 32 new greedy tokens. The
engine's tokens must equal ``model.generate``'s exactly (greedy decisions are far from ties at these logit gaps; a
wrong window, softcap, rotation or padding shows as whole different tokens), in one prefill and in chunks of 100
tokens (a chunk boundary that is no multiple of the window). Far-context control: the same prompts with positions
60-119 changed give other dense tokens, so a decode attention that lost the far context could not pass. A
sliding-window layer's cache is a ring of exactly its window.
"""
from __future__ import annotations

import pytest
import torch

import architecture_zoo as zoo
import retrofit
from retrofit.generation import kept_generation, release
from retrofit.static_cache import RingLayer

PROMPT, NEW, PAD_ROW1 = 300, 32, 37


def prompts(far_change: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, zoo.VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    if far_change:
        ids[:, 60:120] = torch.randint(3, zoo.VOCAB, (2, 60), generator=torch.Generator().manual_seed(99))
    mask = torch.ones_like(ids)
    mask[1, :PAD_ROW1] = 0
    ids[1, :PAD_ROW1] = 0
    return ids, mask


def dense_tokens(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module", params=[row.name for row in zoo.ROWS + zoo.HYBRID_ROWS])
def row(request, one_cpu_thread):
    model = zoo.build(request.param)
    ids, mask = prompts()
    return request.param, model, ids, mask, dense_tokens(model, ids, mask)


def test_far_context_changes_dense_tokens(row):
    name, model, _, _, dense = row
    assert not torch.equal(dense_tokens(model, *prompts(far_change=True))[:, PROMPT:], dense[:, PROMPT:]), name


@pytest.mark.parametrize("prefill_chunk", [4096, 100], ids=["one-prefill", "chunks-of-100"])
def test_engine_tokens_equal_transformers(row, prefill_chunk):
    name, model, ids, mask, dense = row

    def generate():
        return retrofit.generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], prefill_chunk=prefill_chunk)

    if not zoo.refused_unless_interfaced(model, generate):
        return
    tokens = generate()
    assert torch.equal(tokens, dense), f"{name}: {(tokens != dense).sum().item()} tokens differ"


def test_sliding_layers_keep_a_ring_of_their_window(row):
    name, model, ids, mask, _ = row

    def generate():
        return retrofit.generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[])

    if not zoo.refused_unless_interfaced(model, generate):
        return
    generate()
    kept = kept_generation(model)
    try:
        layout = kept.generation.layout
        for index, layer in enumerate(kept.generation.cache.layers):
            window = layout.layers[index].window
            if window is not None and window < kept.generation.capacity:
                assert isinstance(layer, RingLayer) and layer.keys.shape[2] == window, (name, index)
            else:
                assert not isinstance(layer, RingLayer), (name, index)
    finally:
        release(model)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [row.name for row in zoo.ROWS + zoo.HYBRID_ROWS])
def test_engine_tokens_equal_transformers_cuda(name):
    """On CUDA (float32): the decode step captured as a graph, the Triton kernels, the fused layers where the family
    has them, rings for sliding windows: the same tokens as ``model.generate``, in one prefill and in chunks."""
    model = zoo.build(name).cuda()
    ids, mask = (tensor.cuda() for tensor in prompts())
    dense = dense_tokens(model, ids, mask)
    if not zoo.refused_unless_interfaced(model, lambda: retrofit.generate(model, ids, mask, max_new_tokens=NEW)):
        return
    for prefill_chunk in (4096, 100):
        tokens = retrofit.generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[], prefill_chunk=prefill_chunk)
        assert torch.equal(tokens, dense), (name, prefill_chunk, (tokens != dense).sum().item())
    release(model)
