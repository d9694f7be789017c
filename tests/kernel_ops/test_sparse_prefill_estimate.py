"""XAttention's fused estimate (kernels/sparse_prefill/estimate.py) against its PyTorch reference, through
``XAttention.block_mass`` so that the runs it receives are the ones a prefill call builds (chunks after position 0,
left padding, GQA); the reference against the definition written as loops is in tests/test_sparse_prefill.py.

CPU: Triton interpreter, float32. FP32_TOL = 1e-5 relative RMS: kernel and reference do the same fp32 math in a
different order (two passes with an online softmax in exp2, against one softmax per slice); the observed error is
~1e-7, while a causal, padding or chunk mask off by one run, a wrong kv head or a block pair summed into its
neighbour moves whole blocks' mass (errors of order 1e-1; the shapes below all have several blocks per row).
GPU (marked ``gpu``): bf16 runs at Llama-3-8B's shapes; BF16_TOL = 1e-3: both read the same bf16 values, the kernel
multiplies them on tensor cores with fp32 accumulation, the reference in fp32: only summation order differs.
Every buffer the kernel allocates is NaN-poisoned, so statistics it never writes fail the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import use_backend
from retrofit.sparse.prefill.blocks import BlockGrid
from retrofit.sparse.prefill.methods import XAttention

FP32_TOL = 1e-5  # see module docstring
BF16_TOL = 1e-3  # see module docstring

# (B, Hq, Hkv, D, T, q_offset, block_size, stride, padding of the last row): T = 1, 63, 75, 1000 (awkward); q_offset >
# 0 is a later chunk (50, 299: not on a block boundary); 9/3 heads SmolLM2's grouping, 6/2 and 4/1 others, 3/3 none;
# stride 1 at blocks of 128 gives 128 runs a block (a tile larger than the kernel's least)
CASES = {
    "T1-N1": (1, 9, 3, 64, 1, 0, 16, 4, 0),
    "T1-after-299-keys-G4": (2, 4, 1, 16, 1, 299, 16, 2, 40),
    "T63-smollm2-padded": (2, 9, 3, 64, 63, 0, 16, 8, 10),
    "T75-chunk-at-50-padded": (2, 6, 2, 32, 75, 50, 16, 4, 21),
    "T300-mha-stride1": (1, 3, 3, 16, 300, 0, 128, 1, 0),
    "T1000-gqa-padded": (2, 9, 3, 64, 1000, 0, 64, 8, 123),
}


def _inputs(B, Hq, Hkv, D, T, q_offset, block_size, stride, padding, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = q_offset + T
    query = torch.randn(B, T, Hq, D, generator=gen).transpose(1, 2)  # a view, as transformers passes it
    key = torch.randn(B, Hkv, N, D, generator=gen)
    kv_start = torch.zeros(B, dtype=torch.long)
    kv_start[-1] = padding
    grid = BlockGrid(T=T, N=N, q_offset=q_offset, block_size=block_size, kv_start=kv_start.to(device))
    return query.to(device, dtype), key.to(device, dtype), grid


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_estimate_matches_reference_fp32(case):
    *_, block_size, stride, _ = CASES[case]
    query, key, grid = _inputs(*CASES[case])
    method = XAttention(block_size=block_size, stride=stride)
    with use_backend("triton"), nan_poisoned_allocations():
        mass = method.block_mass(query, key, grid, scale=0.3)
    with use_backend("torch"):
        expected = method.block_mass(query, key, grid, scale=0.3)
    assert mass.shape == (grid.kv_start.shape[0], query.shape[1], grid.rows, grid.key_blocks)
    assert not mass.isnan().any()
    assert rel_rms(mass, expected) < FP32_TOL
    causal = grid.causal()
    rows_seeing_keys = expected.sum(-1) > 0
    assert torch.allclose(mass.sum(-1)[rows_seeing_keys], torch.ones(()), atol=1e-5)  # normalised per query block
    assert (mass.masked_fill(causal, 0) == 0).all()  # nothing outside the causal blocks


@pytest.mark.gpu
def test_fused_estimate_bf16_gpu_llama3_shapes():
    """A later 4096-token chunk of an 8,192-token prompt, 32 query / 8 kv heads, head_dim 128, blocks of 128, stride 8
    (the defaults), the last row left-padded by 1,000 tokens."""
    query, key, grid = _inputs(2, 32, 8, 128, 4096, 4096, 128, 8, 1000, dtype=torch.bfloat16, device="cuda")
    method = XAttention()
    with nan_poisoned_allocations():
        mass = method.block_mass(query, key, grid, scale=128 ** -0.5)
    with use_backend("torch"):
        expected = method.block_mass(query, key, grid, scale=128 ** -0.5)
    assert not mass.isnan().any()
    assert rel_rms(mass, expected) < BF16_TOL
