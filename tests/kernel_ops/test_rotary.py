"""The decode token's rotary-embedding Triton kernel, alone and writing k and v into a static cache, against its
PyTorch reference (kernels/rotary/reference.py), and the reference against transformers' ``apply_rotary_pos_emb``
and ``StaticLayer.update`` (the semantics the decode step must keep).

CPU: Triton interpreter, float32. FP32_TOL = 1e-6 relative RMS: two products and a sum per element in float32 in both
(observed ~1e-7, from fused multiply-adds); a wrong half, head, sign or position is of order 1. The cache write is
exact: every position but the written one must keep its value, the written one holds the rotated key (within
FP32_TOL) and the value (exactly).
GPU (marked ``gpu``): bfloat16. BF16_TOL = 4e-3, half a bf16 ulp in RMS: both round each product and the sum to bf16
at the same points, so only rare elements whose float32 product differs in the last bit round differently.
Every buffer the kernel allocates is NaN-poisoned, so unwritten memory fails the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import rotary_qk, rotary_qk_into_cache, rotary_qk_into_cache_ref, rotary_qk_ref

FP32_TOL = 1e-6  # see module docstring
BF16_TOL = 4e-3  # see module docstring

# (B, Hq, Hkv, D, N): batch 1 and 3, SmolLM2's 9/3 heads, Llama-3-8B's 32/8 of 128, MHA, N the cache capacity
CASES = {
    "B1-q32-kv8-D128-llama3": (1, 32, 8, 128, 40),
    "B3-q9-kv3-D64-smollm2": (3, 9, 3, 64, 75),
    "B2-q4-kv4-D16-mha": (2, 4, 4, 16, 8),
    "B3-q6-kv2-D48": (3, 6, 2, 48, 17),
}


def _inputs(B, Hq, Hkv, D, N, dtype=torch.float32, device="cpu", seed=0, cos_rows=None):
    """q, k, v as the projections give them (heads of a [B, H * D] row: strided views), cos/sin as transformers'
    rotary embedding gives them for one token ([B, 1, D], the two halves equal), random caches."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq * D, generator=gen).view(B, Hq, D)
    kv = torch.randn(B, 2 * Hkv * D, generator=gen)
    k, v = kv[:, : Hkv * D].view(B, Hkv, D), kv[:, Hkv * D:].view(B, Hkv, D)
    angles = torch.rand(cos_rows or B, 1, D // 2, generator=gen) * 500
    angles = torch.cat([angles, angles], dim=-1)
    caches = torch.randn(2, B, Hkv, N, D, generator=gen)
    as_device = lambda t: t.to(device, dtype)  # noqa: E731
    return (as_device(q), as_device(k), as_device(v), as_device(angles.cos()), as_device(angles.sin()),
            as_device(caches[0]), as_device(caches[1]))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rotary_qk_matches_reference_fp32(case):
    q, k, _, cos, sin, _, _ = _inputs(*CASES[case])
    with nan_poisoned_allocations():
        q_rotated, k_rotated = rotary_qk(q, k, cos, sin)
    expected_q, expected_k = rotary_qk_ref(q, k, cos, sin)
    assert rel_rms(q_rotated, expected_q) < FP32_TOL and rel_rms(k_rotated, expected_k) < FP32_TOL


@pytest.mark.parametrize("per_row", [False, True], ids=["one-length", "length-per-row"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rotary_qk_into_cache_matches_reference_fp32(case, per_row):
    B, Hq, Hkv, D, N = CASES[case]
    q, k, v, cos, sin, key_cache, value_cache = _inputs(B, Hq, Hkv, D, N)
    # the cache's length counting the new token: a static layer's one counter, or one per row (ragged)
    length = torch.arange(N - B + 1, N + 1) if per_row else torch.tensor(N // 2)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    expected_q = rotary_qk_into_cache_ref(q, k, v, cos, sin, expected_keys, expected_values, length)
    with nan_poisoned_allocations():
        q_rotated = rotary_qk_into_cache(q, k, v, cos, sin, key_cache, value_cache, length)
    assert rel_rms(q_rotated, expected_q) < FP32_TOL
    assert rel_rms(key_cache, expected_keys) < FP32_TOL
    written = torch.zeros(B, N, dtype=torch.bool)
    written[torch.arange(B), length.expand(B) - 1] = True
    assert torch.equal(key_cache[~written[:, None].expand(B, Hkv, N)],
                       expected_keys[~written[:, None].expand(B, Hkv, N)])  # nothing else moved
    assert torch.equal(value_cache, expected_values)


def test_one_row_of_cos_serves_every_row():
    q, k, _, cos, sin, _, _ = _inputs(3, 9, 3, 64, 8, cos_rows=1)
    q_rotated, k_rotated = rotary_qk(q, k, cos, sin)
    expected_q, expected_k = rotary_qk_ref(q, k, cos, sin)
    assert rel_rms(q_rotated, expected_q) < FP32_TOL and rel_rms(k_rotated, expected_k) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_transformers_rotation_and_static_cache_update(dtype):
    """The reference rotates as ``apply_rotary_pos_emb`` and writes where ``StaticLayer.update`` writes (at its
    ``cumulative_length`` before the update, which the reference's ``length`` counts after it), bit for bit."""
    from transformers.cache_utils import StaticLayer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, Hq, Hkv, D, N = CASES["B3-q9-kv3-D64-smollm2"]
    q, k, v, cos, sin, _, _ = _inputs(B, Hq, Hkv, D, N, dtype)
    expected_q, expected_k = apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos, sin)
    layer = StaticLayer(max_cache_len=N)
    layer.update(torch.zeros(B, Hkv, 10, D, dtype=dtype), torch.zeros(B, Hkv, 10, D, dtype=dtype))
    keys, values = layer.update(expected_k, v[:, :, None])
    key_cache, value_cache = torch.zeros_like(keys), torch.zeros_like(values)
    q_rotated = rotary_qk_into_cache_ref(q, k, v, cos, sin, key_cache, value_cache, layer.cumulative_length)
    assert torch.equal(q_rotated, expected_q[:, :, 0])
    assert torch.equal(key_cache, keys) and torch.equal(value_cache, values)


def test_bad_shapes_are_refused():
    q, k, v, cos, sin, key_cache, value_cache = _inputs(3, 9, 3, 64, 8)
    with pytest.raises(ValueError, match="cos"):
        rotary_qk(q, k, cos[:, :, :32], sin)
    with pytest.raises(ValueError, match="caches"):
        rotary_qk_into_cache(q, k, v, cos, sin, key_cache[:2], value_cache, torch.tensor(3))
    with pytest.raises(ValueError, match="length"):
        rotary_qk_into_cache(q, k, v, cos, sin, key_cache, value_cache, torch.tensor([3, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rotary_qk_into_cache_bf16_gpu(case):
    B, Hq, Hkv, D, N = CASES[case]
    q, k, v, cos, sin, key_cache, value_cache = _inputs(B, Hq, Hkv, D, N, torch.bfloat16, "cuda")
    length = torch.tensor(N // 2, device="cuda")
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    expected_q = rotary_qk_into_cache_ref(q, k, v, cos, sin, expected_keys, expected_values, length)
    with nan_poisoned_allocations():
        q_rotated = rotary_qk_into_cache(q, k, v, cos, sin, key_cache, value_cache, length)
        alone_q, alone_k = rotary_qk(q, k, cos, sin)
    assert rel_rms(q_rotated, expected_q) < BF16_TOL
    assert rel_rms(key_cache[:, :, N // 2 - 1], expected_keys[:, :, N // 2 - 1]) < BF16_TOL
    assert torch.equal(value_cache, expected_values)
    expected_alone = rotary_qk_ref(q, k, cos, sin)
    assert rel_rms(alone_q, expected_alone[0]) < BF16_TOL and rel_rms(alone_k, expected_alone[1]) < BF16_TOL
