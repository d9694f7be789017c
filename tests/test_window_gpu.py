"""A hybrid whose converted layers hold a softmax window, generated on CUDA: the decode step (the window's ring
written and read with device ops only) captured as a CUDA graph gives the eager step's tokens, allocates nothing when
replayed and launches one graph per token, with the decoder layers fused or not; on the real SmolLM2 the engine's
greedy tokens equal transformers'. Marked gpu: skipped without CUDA."""
from __future__ import annotations

import copy

import pytest
import torch
from _testing import graph_replay_counts

import retrofit
from retrofit.bench.configs import build_random_model
from retrofit.convert.build import to_hybrid
from retrofit.hybrid import HybridSection

pytestmark = pytest.mark.gpu

WINDOW = {"window": 64, "sink_tokens": 4}


@pytest.fixture(scope="module", params=["gdn", "kda"])
def windowed(request):
    """SmolLM2's shapes with random weights, 4 layers, layers 0-2 converted with a window of 64 and 4 sinks (float32:
    graph and eager run the same kernels, so their tokens must agree exactly)."""
    dense = build_random_model("smollm2-135m", torch.float32, torch.device("cuda"), layers=4)
    return to_hybrid(dense, HybridSection(layers=[0, 1, 2], layer_type=request.param, base_model_type="llama",
                                          layer_spec=WINDOW))


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 49152, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :37] = 0  # ragged: the rows' rings hold other real indices
    return ids, mask


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_graph_replays_give_the_eager_tokens(windowed, fuse_layers):
    ids, mask = _prompt()
    options = {"eos_token_id": [], "pad_token_id": 0, "fuse_layers": fuse_layers}
    eager = retrofit.generate(windowed, ids, mask, max_new_tokens=80, cuda_graph=False, **options)
    graphed = retrofit.generate(windowed, ids, mask, max_new_tokens=80, cuda_graph=True, **options)
    assert torch.equal(eager, graphed), (eager != graphed).sum()


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_replays_allocate_nothing_and_launch_one_graph_per_token(windowed, fuse_layers):
    ids, mask = _prompt()
    allocated, graph_launches, kernel_launches = graph_replay_counts(windowed, ids, mask, fuse_layers, steps=32)
    assert allocated == 0
    assert graph_launches == 32
    assert kernel_launches == 0


@pytest.mark.parametrize("fuse_layers", [False, True])
def test_real_smollm2_windowed_hybrid_equals_transformers_on_cuda(fuse_layers, smollm2):
    """64 new tokens after a ragged batch of 2, float32: the graphed engine (Triton kernels, the window's ring) vs
    transformers' generate over the same hybrid."""
    model, tokenizer = smollm2
    hybrid = to_hybrid(copy.deepcopy(model).to("cuda"),
                       HybridSection(layers=[3, 10, 17, 24], layer_type="gdn", base_model_type="llama",
                                     layer_spec={"window": 16, "sink_tokens": 2}))
    prompts = ["The capital of France is", "Once upon a time, in a small village near the mountains, there lived an old"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to("cuda")
    with torch.no_grad():
        reference = hybrid.generate(**inputs, max_new_tokens=64, do_sample=False, top_p=None, top_k=None,
                                    pad_token_id=tokenizer.pad_token_id)
    tokens = retrofit.generate(hybrid, inputs.input_ids, inputs.attention_mask, max_new_tokens=64,
                               pad_token_id=tokenizer.pad_token_id, cuda_graph=True, fuse_layers=fuse_layers)
    assert torch.equal(tokens, reference), (tokens != reference).sum()
