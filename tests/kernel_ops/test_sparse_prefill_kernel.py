"""Block-sparse prefill attention: the Triton kernel against its PyTorch reference (kernels/sparse_prefill), and the
reference against the definition (dense attention under the mask the selection spells out).

CPU: Triton interpreter, float32. FP32_TOL = 1e-5 relative RMS: kernel, reference and dense attention do the same
fp32 math in a different order (online softmax in exp2 over blocks, a gathered softmax, SDPA); the observed error is
~1e-7, while a wrong head, a block read that was not selected, a causal or padding position let through or a query
block left unwritten gives errors of order 1e-1 (checked below: skipping blocks changes the result by far more).
GPU (marked ``gpu``): bfloat16 inputs; BF16_TOL = 2e-2, because the kernel rounds the softmax weights to bf16 before
the P.V product (as flash attention does) while the reference stays in fp32.
Every buffer the kernel allocates is NaN-poisoned, so a row it never writes fails the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import sparse_prefill_attention, sparse_prefill_attention_ref, use_backend
from retrofit.kernels.sparse_prefill import dense_prefill_attention_ref, query_block_count

FP32_TOL = 1e-5  # see module docstring
BF16_TOL = 2e-2  # see module docstring

# (B, Hq, Hkv, D, T, q_offset, block_size, padding of the last row): T = 1, 63, 75, 1000 (awkward); q_offset > 0 is a
# later chunk of a chunked prefill (50: not on a block boundary); 9/3 heads is SmolLM2's GQA, 6/2 and 4/1 other
# groups, 3/3 no grouping; padding: the last row's left padding (kv_start), the first row has none
CASES = {
    "T1-N1": (1, 9, 3, 64, 1, 0, 16, 0),
    "T1-after-299-keys-G4": (2, 4, 1, 16, 1, 299, 16, 40),
    "T63-smollm2-padded": (2, 9, 3, 64, 63, 0, 16, 10),
    "T75-chunk-at-50-padded": (2, 6, 2, 32, 75, 50, 16, 21),
    "T75-mha-D48": (1, 3, 3, 48, 75, 0, 32, 0),
    "T1000-gqa-padded": (2, 9, 3, 64, 1000, 0, 64, 123),
}


def _inputs(B, Hq, Hkv, D, T, q_offset, block_size, padding, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = q_offset + T
    q = torch.randn(B, T, Hq, D, generator=gen).transpose(1, 2)  # [B, Hq, T, D] as a view, as transformers passes it
    k = torch.randn(B, Hkv, N, D, generator=gen)
    v = torch.randn(B, Hkv, N, D, generator=gen)
    kv_start = torch.zeros(B, dtype=torch.int32)
    kv_start[-1] = padding
    as_device = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return as_device(q), as_device(k), as_device(v), kv_start.to(device)


def _selection(B, Hq, T, q_offset, block_size, density, seed=1, device="cpu"):
    """Per (row, head, query block) a random subset of the causal key blocks (each kept with probability
    ``density``; 1.0 keeps them all), listed in random order; one row of each head left empty."""
    gen = torch.Generator().manual_seed(seed)
    first = q_offset // block_size
    rows = query_block_count(q_offset, T, block_size)
    width = first + rows
    indices = torch.zeros(B, Hq, rows, width, dtype=torch.int32)
    counts = torch.zeros(B, Hq, rows, dtype=torch.int32)
    for b in range(B):
        for h in range(Hq):
            for row in range(rows):
                causal = torch.arange(first + row + 1)
                kept = causal[torch.rand(len(causal), generator=gen) < density] if density < 1 else causal
                kept = kept[torch.randperm(len(kept), generator=gen)]
                indices[b, h, row, : len(kept)] = kept.to(torch.int32)
                counts[b, h, row] = len(kept)
    if density < 1 and rows > 1:
        counts[:, :, rows // 2] = 0
    return indices.to(device), counts.to(device)


def _masked_dense(q, k, v, indices, counts, kv_start, block_size, q_offset):
    """The definition: softmax over the keys that are causal, valid and in a selected block, written as one dense
    [B, Hq, T, N] mask (rows with no such key: zeros)."""
    B, Hq, T, D = q.shape
    N = k.shape[2]
    first = q_offset // block_size
    positions = torch.arange(q_offset, q_offset + T)
    keys = torch.arange(N)
    selected = torch.zeros(B, Hq, T, N, dtype=torch.bool)
    for b in range(B):
        for h in range(Hq):
            for i, p in enumerate(positions.tolist()):
                row = p // block_size - first
                for block in indices[b, h, row, : counts[b, h, row]].tolist():
                    selected[b, h, i, block * block_size: (block + 1) * block_size] = True
    visible = selected & (keys <= positions[:, None]) & (keys >= kv_start.long()[:, None, None, None])
    scores = torch.einsum("bhtd,bhnd->bhtn", q.float(), k.float().repeat_interleave(Hq // k.shape[1], 1)) * D**-0.5
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhtn,bhnd->bthd", weights, v.float().repeat_interleave(Hq // k.shape[1], 1))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sparse_prefill_kernel_matches_reference_fp32(case):
    """Half of the causal blocks, in random order, one query block of each head with none (the kernel at every block
    is checked against dense attention below)."""
    B, Hq, Hkv, D, T, q_offset, block_size, padding = CASES[case]
    q, k, v, kv_start = _inputs(*CASES[case])
    indices, counts = _selection(B, Hq, T, q_offset, block_size, 0.5)
    with use_backend("triton"), nan_poisoned_allocations():
        out = sparse_prefill_attention(q, k, v, indices, counts, kv_start, block_size)
    with use_backend("torch"):
        expected = sparse_prefill_attention(q, k, v, indices, counts, kv_start, block_size)
    assert out.shape == (B, T, Hq, D)
    assert not out.isnan().any()
    assert rel_rms(out, expected) < FP32_TOL


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_block_selected_is_dense_attention(case):
    """At density 1.0 (every causal block) kernel and reference return dense causal attention (SDPA under the causal
    and padding mask); at density 0.5 they do not (so the comparison can fail)."""
    B, Hq, Hkv, D, T, q_offset, block_size, padding = CASES[case]
    q, k, v, kv_start = _inputs(*CASES[case])
    dense = dense_prefill_attention_ref(q, k, v, kv_start)
    indices, counts = _selection(B, Hq, T, q_offset, block_size, 1.0)
    with use_backend("triton"):
        kernel = sparse_prefill_attention(q, k, v, indices, counts, kv_start, block_size)
    reference = sparse_prefill_attention_ref(q, k, v, indices, counts, kv_start, block_size)
    assert rel_rms(kernel, dense) < FP32_TOL
    assert rel_rms(reference, dense) < FP32_TOL
    if q_offset + T > 2 * block_size:  # more than two causal blocks: a random half must skip some that matter
        half = sparse_prefill_attention_ref(q, k, v, *_selection(B, Hq, T, q_offset, block_size, 0.5), kv_start,
                                            block_size)
        assert rel_rms(half, dense) > 1e-2


@pytest.mark.parametrize("case", ["T63-smollm2-padded", "T75-chunk-at-50-padded", "T1-after-299-keys-G4"])
def test_reference_is_attention_under_the_selected_blocks_mask(case):
    """The reference (one gathered softmax per query block) equals the definition written as one dense mask."""
    B, Hq, Hkv, D, T, q_offset, block_size, padding = CASES[case]
    q, k, v, kv_start = _inputs(*CASES[case])
    indices, counts = _selection(B, Hq, T, q_offset, block_size, 0.5)
    expected = _masked_dense(q, k, v, indices, counts, kv_start, block_size, q_offset)
    assert rel_rms(sparse_prefill_attention_ref(q, k, v, indices, counts, kv_start, block_size), expected) < FP32_TOL


def test_explicit_query_offset_inside_a_longer_buffer():
    """``q_offset`` set explicitly (keys past the chunk in the buffer are never visible to it): the same as the
    chunk over exactly its keys."""
    B, Hq, Hkv, D, T, q_offset, block_size, padding = CASES["T75-chunk-at-50-padded"]
    q, k, v, kv_start = _inputs(*CASES["T75-chunk-at-50-padded"])
    indices, counts = _selection(B, Hq, T, q_offset, block_size, 0.5)
    longer_k = torch.cat([k, torch.randn(B, Hkv, 40, D)], 2)
    longer_v = torch.cat([v, torch.randn(B, Hkv, 40, D)], 2)
    with use_backend("triton"):
        out = sparse_prefill_attention(q, longer_k, longer_v, indices, counts, kv_start, block_size, q_offset=q_offset)
    expected = sparse_prefill_attention_ref(q, k, v, indices, counts, kv_start, block_size)
    assert rel_rms(out, expected) < FP32_TOL


def test_bad_block_size_and_selection_shape_are_refused():
    q, k, v, kv_start = _inputs(*CASES["T63-smollm2-padded"])
    indices, counts = _selection(2, 9, 63, 0, 16, 1.0)
    with use_backend("triton"):
        with pytest.raises(ValueError, match="power of two"):
            sparse_prefill_attention(q, k, v, indices, counts, kv_start, 24)
        with pytest.raises(ValueError, match="query blocks"):
            sparse_prefill_attention(q, k, v, indices[:, :, :2], counts[:, :, :2], kv_start, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.25, 1.0], ids=["quarter", "full"])
@pytest.mark.parametrize("case", ["T75-chunk-at-50-padded", "T1000-gqa-padded"])
def test_sparse_prefill_kernel_bf16_gpu(case, density):
    B, Hq, Hkv, D, T, q_offset, block_size, padding = CASES[case]
    q, k, v, kv_start = _inputs(*CASES[case], dtype=torch.bfloat16, device="cuda")
    indices, counts = _selection(B, Hq, T, q_offset, block_size, density, device="cuda")
    with nan_poisoned_allocations():
        out = sparse_prefill_attention(q, k, v, indices, counts, kv_start, block_size)
    expected = sparse_prefill_attention_ref(q.float(), k.float(), v.float(), indices, counts, kv_start, block_size)
    assert not out.isnan().any()
    assert rel_rms(out, expected) < BF16_TOL


@pytest.mark.gpu
def test_sparse_prefill_kernel_bf16_gpu_llama3_shapes():
    """A later 4096-token chunk of an 8192-token prompt at Llama-3-8B's attention shapes (32 query / 8 kv heads,
    head_dim 128, blocks of 128), a quarter of the blocks selected."""
    B, Hq, Hkv, D, T, q_offset, block_size = 1, 32, 8, 128, 4096, 4096, 128
    q, k, v, kv_start = _inputs(B, Hq, Hkv, D, T, q_offset, block_size, 0, dtype=torch.bfloat16, device="cuda")
    indices, counts = _selection(B, Hq, T, q_offset, block_size, 0.25, device="cuda")
    out = sparse_prefill_attention(q, k, v, indices, counts, kv_start, block_size)
    expected = sparse_prefill_attention_ref(q.float(), k.float(), v.float(), indices, counts, kv_start, block_size)
    assert rel_rms(out, expected) < BF16_TOL
