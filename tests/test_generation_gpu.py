"""retrofit.generate on CUDA: the decode step captured as a CUDA graph gives the eager step's tokens, allocates
nothing when replayed, and the host issues one graph launch per token; on the real SmolLM2 the engine's greedy tokens
equal transformers' (dense, Quest at a budget covering the context, a converted hybrid). Marked gpu: skipped
without CUDA."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from _testing import graph_replay_counts

import retrofit
from retrofit.bench.configs import build_random_model
from retrofit.sparse import sparse_decoding
from retrofit.variants import parse_variant_spec

pytestmark = pytest.mark.gpu

SPARSE = {
    "quest": {"page_size": 16, "dense_layers": (0,)},
    "streaming": {"n_sink": 4},
    "clusterkv": {"n_clusters": 16, "iterations": 3, "recluster_every": 16, "new_clusters": 2, "n_sink": 4},
    "seer": {"random_gates": True},
}
VARIANTS = ["dense", *SPARSE, "convert:gdn:not:every:4", "convert:kda:not:every:4"]


@pytest.fixture(scope="module")
def cuda_model():
    # float32: graph and eager run the same Triton kernels, so their tokens must agree exactly
    return build_random_model("smollm2-135m", torch.float32, torch.device("cuda"), layers=4)


@contextlib.contextmanager
def _opened(model, variant: str):
    if variant in SPARSE:
        with sparse_decoding(model, method=variant, budget=128, **SPARSE[variant]):
            yield model
    else:
        with parse_variant_spec(variant).open(model, None) as opened:
            yield opened


def _prompt(batch: int = 2, length: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 49152, (batch, length), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :37] = 0  # ragged
    return ids, mask


FUSED_VARIANTS = ["dense", "quest", "convert:gdn:not:every:4"]


@pytest.mark.parametrize(("variant", "fuse_layers"), [*((v, False) for v in VARIANTS),
                                                      *((v, True) for v in FUSED_VARIANTS)])
def test_graph_replays_give_the_eager_tokens(cuda_model, variant, fuse_layers):
    ids, mask = _prompt()
    options = {"eos_token_id": [], "pad_token_id": 0, "fuse_layers": fuse_layers}
    with _opened(cuda_model, variant) as model:
        eager = retrofit.generate(model, ids, mask, max_new_tokens=48, cuda_graph=False, **options)
        graphed = retrofit.generate(model, ids, mask, max_new_tokens=48, cuda_graph=True, **options)
        sampled = [retrofit.generate(model, ids, mask, max_new_tokens=24, do_sample=True, seed=5,
                                     cuda_graph=graph, **options) for graph in (False, True)]
    assert torch.equal(eager, graphed), (eager != graphed).sum()
    assert torch.equal(sampled[0], sampled[1])  # the generator's state advances in the graph as eagerly


@pytest.mark.parametrize("fuse_layers", [False, True])
@pytest.mark.parametrize("variant", FUSED_VARIANTS)
def test_replays_allocate_nothing_and_launch_one_graph_per_token(cuda_model, variant, fuse_layers):
    ids, mask = _prompt()
    with _opened(cuda_model, variant) as model:
        allocated, graph_launches, kernel_launches = graph_replay_counts(model, ids, mask, fuse_layers, steps=32)
    assert allocated == 0  # replays allocate nothing
    assert graph_launches == 32
    assert kernel_launches == 0  # every kernel of a step runs inside the graph


@pytest.mark.parametrize("variant", ["dense", "convert:gdn:not:every:4", "convert:kda:not:every:4"])
def test_a_second_call_of_the_same_bucket_replays_the_first_calls_graph(cuda_model, variant):
    """No capture and no new cache in the second call: its prompt (another length, the same 512 bucket) goes
    into the first call's tensors and the first call's graph replays from the first decode step on."""
    from retrofit.generation import kept_generation, release

    ids, mask = _prompt()
    other_ids, other_mask = ids[:, 20:].flip(0).contiguous(), mask[:, 20:].flip(0).contiguous()
    with _opened(cuda_model, variant) as model:
        release(model)
        retrofit.generate(model, ids, mask, max_new_tokens=40, eos_token_id=[], pad_token_id=0, cuda_graph=True)
        first = kept_generation(model)
        assert first is not None and first.captured is not None
        reused = retrofit.generate(model, other_ids, other_mask, max_new_tokens=24, eos_token_id=[], pad_token_id=0,
                                   cuda_graph=True)
        second = kept_generation(model)
        assert second.captured is first.captured and second.generation is first.generation
        fresh = retrofit.generate(model, other_ids, other_mask, max_new_tokens=24, eos_token_id=[], pad_token_id=0,
                                  cuda_graph=False, keep_state=False)
        release(model)
    assert torch.equal(reused, fresh), (reused != fresh).sum()


def test_retrieval_runs_eagerly_on_cuda(cuda_model):
    pytest.importorskip("faiss")
    ids, mask = _prompt()
    with sparse_decoding(cuda_model, method="retrieval", budget=128):
        tokens = retrofit.generate(cuda_model, ids, mask, max_new_tokens=8, eos_token_id=[], pad_token_id=0)
        with pytest.raises(retrofit.RetrofitError, match="cannot be captured"):
            retrofit.generate(cuda_model, ids, mask, max_new_tokens=8, cuda_graph=True)
    assert tokens.shape == (2, 308)


@pytest.fixture(scope="module")
def smollm2_cuda(smollm2):
    model, tokenizer = smollm2
    return copy.deepcopy(model).to("cuda"), tokenizer


@pytest.mark.parametrize("fuse_layers", [False, True])
@pytest.mark.parametrize("variant", ["dense", "quest", "hybrid"])
def test_real_smollm2_engine_equals_transformers_on_cuda(variant, fuse_layers, smollm2_cuda):
    """64 new tokens, ragged batch of 2, fp32: graphed engine (Triton kernels, the decoder layers fused or the
    model's own) vs transformers' generate (SDPA)."""
    from retrofit.convert.build import to_hybrid
    from retrofit.hybrid import HybridSection

    model, tokenizer = smollm2_cuda
    if variant == "hybrid":
        model = to_hybrid(model, HybridSection(layers=[3, 10, 17, 24], layer_type="gdn", base_model_type="llama"))
    prompts = ["The capital of France is", "Once upon a time, in a small village near the mountains, there lived an old"]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to("cuda")
    with torch.no_grad():
        reference = model.generate(**inputs, max_new_tokens=64, do_sample=False, top_p=None, top_k=None,
                                   pad_token_id=tokenizer.pad_token_id)
    session = (sparse_decoding(model, method="quest", budget=512, dense_layers=()) if variant == "quest"
               else contextlib.nullcontext())
    with session:
        tokens = retrofit.generate(model, inputs.input_ids, inputs.attention_mask, max_new_tokens=64,
                                   pad_token_id=tokenizer.pad_token_id, cuda_graph=True, fuse_layers=fuse_layers)
    assert torch.equal(tokens, reference), (tokens != reference).sum()


@pytest.mark.parametrize("variant", ["quest", "clusterkv", "streaming"])
def test_calls_in_a_sparse_session_hold_no_more_after_each_call(cuda_model, variant):
    """Each call of a sparse session captures its own decode step and drops it: what the call held (its cache,
    through the fused forwards' cycle; the capture's cuBLAS workspace, 32 MiB on Hopper) is freed when it returns, so
    the memory held after the fourth call equals the memory held after the first (measured before: +7 GiB a call at
    8K x 32, and +32 MiB a call from the workspaces alone)."""
    retrofit.generation.release(cuda_model)
    ids = torch.randint(100, 1000, (2, 200), device="cuda")
    mask = torch.ones_like(ids)
    held = []
    with _opened(cuda_model, variant):
        for _ in range(4):
            retrofit.generate(cuda_model, ids, mask, max_new_tokens=6, eos_token_id=[], pad_token_id=0)
            torch.cuda.synchronize()
            held.append(torch.cuda.memory_allocated())
    assert held[3] == held[0], [value / 2 ** 20 for value in held]
