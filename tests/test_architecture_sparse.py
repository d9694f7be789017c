"""Every sparse method on every architecture row of the zoo (tests/architecture_zoo.py).

At a budget covering the context (1,024 >= 300 + 16) every method reads every valid key: ``model.generate`` inside
the session and ``retrofit.generate`` inside it give the dense tokens exactly (greedy; see test_sparse_decoding.py for
why no tolerance is needed). At a budget of 64 the generation runs to the end and every patched layer ran the sparse
kernel on every decode step. Only layers whose cache grows with the context are patched: a model whose layers are all
sliding-window ones is refused in one line, and Qwen3-Next keeps its own linear-attention layers.
"""
from __future__ import annotations

import pytest
import torch

import architecture_zoo as zoo
import retrofit
from retrofit.errors import RetrofitError
from retrofit.sparse import METHODS, SparseLayer, softmax_attention_layers, sparse_decoding

NEW = 16
EXACT = {"streaming": {}, "quest": {"dense_layers": ()},
         "clusterkv": {"n_clusters": 6, "iterations": 5, "recluster_every": 5, "new_clusters": 2, "n_sink": 4},
         "retrieval": {"n_sink": 4, "window": 4, "index": "Flat"}, "seer": {"random_gates": True}}
SMALL = {"streaming": {"n_sink": 4}, "quest": {"dense_layers": (), "page_size": 8},
         "clusterkv": {"n_clusters": 12, "iterations": 5, "n_sink": 4},
         "retrieval": {"n_sink": 4, "window": 4, "index": "HNSW32", "ef_search": 32, "query": "union"},
         "seer": {"random_gates": True}}
ALL_SLIDING = {"mistral-window64"}  # nothing grows with the context: nothing for a sparse method to do
ROWS = [row.name for row in zoo.ROWS + zoo.HYBRID_ROWS if row.name not in ALL_SLIDING]


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, zoo.VOCAB, (2, 300), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    ids[1, :37] = 0
    return ids, mask


def hf_generate(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)


def _open(model, method: str, budget: int, settings: dict) -> None:
    with sparse_decoding(model, method=method, budget=budget, **settings[method]):
        pass


@pytest.fixture(scope="module", params=ROWS)
def row(request, one_cpu_thread):
    model = zoo.build(request.param)
    ids, mask = prompts()
    return request.param, model, ids, mask, hf_generate(model, ids, mask)


def test_methods_have_zoo_settings():
    assert set(METHODS.names()) == set(EXACT) == set(SMALL)


@pytest.mark.parametrize("method", METHODS.names())
def test_budget_covering_the_context_gives_dense_tokens(row, method):
    name, model, ids, mask, dense = row
    if not zoo.refused_unless_interfaced(model, lambda: _open(model, method, 1024, EXACT)):
        return
    with sparse_decoding(model, method=method, budget=1024, **EXACT[method]):
        assert torch.equal(hf_generate(model, ids, mask), dense), (name, "model.generate")
        engine = retrofit.generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[])
    assert torch.equal(engine, dense), (name, "retrofit.generate")


@pytest.mark.parametrize("method", METHODS.names())
def test_small_budget_runs_sparse_on_every_patched_layer(row, method):
    name, model, ids, mask, _ = row
    if not zoo.refused_unless_interfaced(model, lambda: _open(model, method, 64, SMALL)):
        return
    patched = softmax_attention_layers(model)
    with sparse_decoding(model, method=method, budget=64, **SMALL[method]) as session:
        tokens = retrofit.generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=[])
        steps = {index: layer.sparse_steps for index, layer in enumerate(session.cache.layers)
                 if isinstance(layer, SparseLayer)}
    assert tokens.shape == (2, 300 + NEW)
    assert set(steps) == set(patched) and set(steps.values()) == {NEW - 1}, (name, steps)


def test_only_layers_whose_cache_grows_are_patched():
    gemma3, qwen3_next = zoo.build("gemma3"), zoo.build("qwen3_next")
    assert list(softmax_attention_layers(gemma3)) == [1, 3]  # the full-attention layers; the sliding ones stay
    assert list(softmax_attention_layers(qwen3_next)) == [1, 3]  # its own linear-attention layers stay
    with pytest.raises(RetrofitError, match="sliding-window layers are bounded already") as err:
        with sparse_decoding(zoo.build("mistral-window64"), method="quest", budget=64):
            pass
    assert "\n" not in str(err.value)
