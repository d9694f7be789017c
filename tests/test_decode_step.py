"""The decode step of retrofit.generate is capturable: it reads the device on the host at most once per
``stop_check_every`` tokens, allocates no cache tensor after the first step, and issues the same operations with the
same shapes and arguments every step (what a CUDA graph records and replays). Checked on the CPU, through a
TorchDispatchMode, on SmolLM2's shapes with 4 layers and random weights (the properties do not depend on the values;
counts are deterministic)."""
from __future__ import annotations

import contextlib

import pytest
import torch

import retrofit
from retrofit.bench.configs import build_random_model
from retrofit.bench.memory import reachable_tensors
from retrofit.bench.overhead import DispatchCount, per_decode_token
from retrofit.generation import StaticGeneration
from retrofit.generation.inputs import SamplingOptions
from retrofit.generation.sampling import TokenChooser
from retrofit.sparse import sparse_decoding
from retrofit.variants import parse_variant_spec

PROMPT_LENGTH = 96
# settings that make each method's machinery run on a 96-token prompt at budget 32 (ClusterKV re-clusters twice in
# 32 steps, Seer's untrained gates score every block)
SPARSE = {
    "streaming": {"n_sink": 4},
    "quest": {"dense_layers": (0,), "page_size": 8},
    "clusterkv": {"n_clusters": 8, "iterations": 3, "recluster_every": 12, "new_clusters": 2, "n_sink": 4},
    "seer": {"random_gates": True},
}
VARIANTS = ["dense", *SPARSE, "convert:gdn:not:every:4", "convert:kda:not:every:4"]


@pytest.fixture(scope="module")
def model(one_cpu_thread):
    return build_random_model("smollm2-135m", torch.float32, torch.device("cpu"), layers=4)


@contextlib.contextmanager
def _opened(model, variant: str):
    """The model as the variant runs it."""
    if variant in SPARSE:
        budget = 64 if variant == "seer" else 32  # Seer's random gates read blocks of 64
        with sparse_decoding(model, method=variant, budget=budget, **SPARSE[variant]):
            yield model
    else:
        with parse_variant_spec(variant).open(model, None) as opened:
            yield opened


def _prompt(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 49152, (batch, PROMPT_LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0  # ragged: row 0 left-padded by 10
    return ids, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_at_most_one_host_sync_per_eight_tokens(model, variant):
    ids, mask = _prompt()
    with _opened(model, variant) as measured:
        counts = per_decode_token(lambda n: retrofit.generate(measured, ids, mask, max_new_tokens=n, eos_token_id=[],
                                                              pad_token_id=0))
    # 32 decode steps with the stop check every 16 tokens: 2 host reads, nothing else reads the device
    assert counts.syncs == 2 / 32, counts
    assert counts.syncs <= 1 / 8


def test_retrieval_states_its_host_work(model):
    """RetrievalAttention searches in faiss on the host: not capturable. Its positions are host-known, so on the CPU
    the dispatcher sees no more reads than the stop checks; on CUDA each layer and step also copies the query to the
    host (a synchronisation) and the hits back, which the CPU cannot see (no device)."""
    ids, mask = _prompt()
    with sparse_decoding(model, method="retrieval", budget=32, n_sink=4, window=8) as session:
        counts = per_decode_token(lambda n: retrofit.generate(model, ids, mask, max_new_tokens=n, eos_token_id=[],
                                                              pad_token_id=0))
        assert not session.method.capturable
    assert counts.syncs == 2 / 32


def _generation(model, ids, mask, new_tokens: int) -> StaticGeneration:
    generation = StaticGeneration(model, ids, mask, new_tokens, TokenChooser(SamplingOptions(), ids.device), [], 0)
    return generation


@pytest.mark.parametrize("variant", VARIANTS)
def test_steps_allocate_no_cache_tensor_and_repeat_the_same_operations(model, variant):
    ids, mask = _prompt()
    with _opened(model, variant) as measured, torch.no_grad():
        generation = _generation(measured, ids, mask, 40)
        with generation.installed():
            generation.prefill()
            generation.step()  # the first step may allocate (StreamingLLM evicts into its ring here)
            generation.after_step()
            before = reachable_tensors(generation.cache_state())
            traces = []
            for _ in range(32):
                with DispatchCount(record=True) as count:
                    generation.step()
                generation.after_step()  # host upkeep between steps (ClusterKV's schedule), outside the step
                traces.append(count.trace)
            after = reachable_tensors(generation.cache_state())
    # every tensor the decode state holds after step 1 is still held, at the same address, shape and dtype
    assert before == after
    assert len(before) >= 2 * 4  # at least K and V (or conv and recurrent states) of 4 layers
    # 32 steps issue the same operations on tensors of the same shapes, strides and offsets with the same
    # arguments: nothing depends on a host counter that changes between steps
    assert all(trace == traces[0] for trace in traces), variant


def test_the_output_buffer_and_flags_are_updated_in_place(model):
    ids, mask = _prompt(batch=1)
    with torch.no_grad():
        generation = _generation(model, ids, mask, 8)
        with generation.installed():
            generation.prefill()
            out = generation.out.data_ptr()
            for _ in range(7):
                generation.step()
                generation.after_step()
    assert generation.out.data_ptr() == out and int(generation.step_index) == 8
    assert generation.produced() == 8


def test_the_kernel_path_of_a_dense_step_matches_its_pytorch_path(model):
    """On CUDA a dense decode step reads the static buffer through the Triton sparse-decode kernel (every block,
    each row's valid range); on the CPU through SDPA over the same range. Run here through Triton's interpreter, the
    kernel's logits must be the SDPA path's up to fp32 summation order (1e-4 on logits of magnitude ~1 is 100x the
    ~1e-6 such reorderings give over 300 keys, far below a change of the computation)."""
    from retrofit.kernels import use_backend

    ids, mask = _prompt()
    logits = []
    for backend in ("torch", "triton"):
        with torch.no_grad(), use_backend(backend):
            generation = _generation(model, ids, mask, 4)
            with generation.installed():
                generation.prefill()
                logits.append(generation._forward(generation.tokens[:, None], generation.positions, None))
    assert (logits[0] - logits[1]).abs().max() < 1e-4


def test_the_kernel_path_of_a_seer_step_matches_its_pytorch_path(model):
    """SeerAttention's decode step on the Triton kernels (the newest block's gate key pooled, projected and written in
    one kernel; the gate's scale applied in the scoring kernel) against its PyTorch path (pooling, ``nn.Linear``,
    ``index_copy_``, the scale on the projected query), through Triton's interpreter: 200 prompt tokens in blocks of
    64 with a budget of two blocks, so each step chooses one of the older blocks by its gate score. The tokens must
    be equal and the gate keys equal up to fp32 summation order (1e-5 relative RMS: ~1e-7 is the reordering of 192
    products, a wrong channel, block or scale moves them by O(1))."""
    from _testing import rel_rms
    from retrofit.kernels import use_backend

    ids = torch.randint(0, 49152, (2, 200), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    runs = []
    for backend in ("torch", "triton"):
        with torch.no_grad(), use_backend(backend), sparse_decoding(model, method="seer", budget=128,
                                                                      random_gates=True):
            generation = _generation(model, ids, mask, 6)
            with generation.installed():
                generation.prefill()
                for _ in range(5):
                    generation.step()
                    generation.after_step()
            gate_keys = [layer.meta["gate_keys"].clone() for layer in generation.cache.layers]
            runs.append((generation.out[:, :6].clone(), gate_keys, [layer.sparse_steps for layer in
                                                                    generation.cache.layers]))
    (tokens, keys, steps), (kernel_tokens, kernel_keys, kernel_steps) = runs
    assert torch.equal(tokens, kernel_tokens)
    assert steps == kernel_steps == [5] * len(steps)  # every step selected, on both paths
    for mine, theirs in zip(kernel_keys, keys, strict=True):
        assert rel_rms(mine, theirs) < 1e-5


@pytest.mark.parametrize("prefill_chunk", [32, 4096], ids=["prompt-in-3-chunks", "prompt-in-one-chunk"])
def test_clusterkv_static_buffers_hold_the_scheduled_clusters_of_the_whole_prompt(model, prefill_chunk):
    """A static cache holds ClusterKV's prompt clusters plus ``new_clusters`` per ``recluster_every`` tokens left
    after the whole prompt, whatever the prefill's chunks: each step scores and ranks every slot, so slots sized from
    the first chunk's end (8 + 2 x 64 // 12 = 10 more here; ~3,100 more for 127K in chunks of 4K) are paid every
    token. The slots the schedule fills, and no more."""
    ids, mask = _prompt()
    settings = dict(n_clusters=8, iterations=3, recluster_every=12, new_clusters=2, n_sink=4)
    with torch.no_grad(), sparse_decoding(model, method="clusterkv", budget=32, **settings):
        generation = StaticGeneration(model, ids, mask, 40, TokenChooser(SamplingOptions(), ids.device), [], 0,
                                      prefill_chunk=prefill_chunk)
        with generation.installed():
            generation.prefill()
            for _ in range(39):
                generation.step()
                generation.after_step()
        layers = generation.cache.layers
    capacity = layers[0].capacity
    slots = 8 + 2 * ((capacity - PROMPT_LENGTH) // 12)
    for layer in layers:
        assert layer.meta["sizes"].shape[2] == layer.meta["centroids"].shape[2] == slots
        # the prompt's 8 clusters and one batch of 2 per 12 tokens decoded so far (39 steps: 3 batches)
        assert layer.meta["num_clusters"] == 8 + 2 * 3
        assert int((layer.meta["sizes"] > 0).any(dim=(0, 1)).sum()) <= 8 + 2 * 3
