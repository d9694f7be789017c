"""Rotary position embedding of one decode token's q and k in one Triton launch, optionally fused with writing the
rotated key and the value into a static KV cache (one launch instead of the model's rotation ops on q and k plus the
cache's index arithmetic and two index copies).

One program per (row, head): heads ``[0, Hq)`` rotate a query head, heads ``[Hq, Hq + Hkv)`` a key head (and copy
its value head into the cache). float32 math with the model's rounding; semantics in ``reference.py`` beside this
file. Inference only; the cache position is read on the device (no host synchronisation: CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation


@triton.jit
def _rotate(x_ptr, cos1, cos2, sin1, sin2, half, inside, HALF):
    """The two halves of ``x * cos + rotate_half(x) * sin``, each product and the sum rounded to x's dtype."""
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + half, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + half, mask=inside, other=0.0).to(tl.float32)
    first = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    second = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    return first, second


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, key_cache_ptr, value_cache_ptr, length_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cosb, stride_sinb,
    stride_qob, stride_qoh, stride_kob, stride_koh,
    stride_kcb, stride_kch, stride_kcn, stride_vcb, stride_vch, stride_vcn, stride_length,
    Hq, HALF, INTO_CACHE: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, BLOCK_HALF)
    inside = half < HALF
    dtype = q_ptr.dtype.element_ty
    cos1 = tl.load(cos_ptr + b * stride_cosb + half, mask=inside, other=0.0).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + b * stride_cosb + HALF + half, mask=inside, other=0.0).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + b * stride_sinb + half, mask=inside, other=0.0).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + b * stride_sinb + HALF + half, mask=inside, other=0.0).to(dtype).to(tl.float32)
    if head < Hq:
        first, second = _rotate(q_ptr + b * stride_qb + head * stride_qh, cos1, cos2, sin1, sin2, half, inside, HALF)
        out = q_out_ptr + b * stride_qob + head * stride_qoh
        tl.store(out + half, first.to(q_out_ptr.dtype.element_ty), mask=inside)
        tl.store(out + HALF + half, second.to(q_out_ptr.dtype.element_ty), mask=inside)
    else:
        h = head - Hq
        first, second = _rotate(k_ptr + b * stride_kb + h * stride_kh, cos1, cos2, sin1, sin2, half, inside, HALF)
        if INTO_CACHE:
            slot = tl.load(length_ptr + b * stride_length).to(tl.int64) - 1
            key = key_cache_ptr + b * stride_kcb + h * stride_kch + slot * stride_kcn
            tl.store(key + half, first.to(key_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(key + HALF + half, second.to(key_cache_ptr.dtype.element_ty), mask=inside)
            value_in = v_ptr + b * stride_vb + h * stride_vh
            value = value_cache_ptr + b * stride_vcb + h * stride_vch + slot * stride_vcn
            v1 = tl.load(value_in + half, mask=inside, other=0.0)
            v2 = tl.load(value_in + HALF + half, mask=inside, other=0.0)
            tl.store(value + half, v1.to(value_cache_ptr.dtype.element_ty), mask=inside)
            tl.store(value + HALF + half, v2.to(value_cache_ptr.dtype.element_ty), mask=inside)
        else:
            out = k_out_ptr + b * stride_kob + h * stride_koh
            tl.store(out + half, first.to(k_out_ptr.dtype.element_ty), mask=inside)
            tl.store(out + HALF + half, second.to(k_out_ptr.dtype.element_ty), mask=inside)


def _row_stride(table: torch.Tensor, name: str, B: int, D: int) -> int:
    """Stride between the rows of ``cos``/``sin``: ``[B, D]`` or transformers' ``[B, 1, D]``; 0 when one row (B = 1)
    serves every row."""
    rows = table.shape[0] if table.dim() in (2, 3) else -1
    if rows not in (1, B) or table.shape[-1] != D or table.numel() != rows * D or table.stride(-1) != 1:
        raise ValueError(f"{name} must be [B, D] or [B, 1, D] (B = {B} or 1, D = {D}) with a contiguous last "
                         f"dimension, got {tuple(table.shape)}")
    return 0 if rows == 1 else table.stride(0)


def _checked(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [B, Hq, D] and k [B, Hkv, D] must share B and D, got {tuple(q.shape)}, {tuple(k.shape)}")
    B, Hq, D = q.shape
    if D % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"the head dimension must be even and contiguous (D = {D})")
    return B, Hq, k.shape[1], D


def _launch(q, k, v, cos, sin, key_cache, value_cache, length, k_out):
    B, Hq, Hkv, D = _checked(q, k)
    q_out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    into_cache = key_cache is not None
    if into_cache:
        cache_shape = (B, Hkv, key_cache.shape[2], D)
        if key_cache.shape != cache_shape or value_cache.shape != cache_shape or v.shape != k.shape:
            raise ValueError(f"key/value caches must be {list(cache_shape)} and v {list(k.shape)}, got "
                             f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}, {tuple(v.shape)}")
        if length.numel() not in (1, B):
            raise ValueError(f"length must hold one position or one per row ({B}), got {length.numel()}")
        if v.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
            raise ValueError("v and the caches need a contiguous last dimension")
        length_stride = 0 if length.numel() == 1 else length.reshape(-1).stride(0)
        v_strides = (v.stride(0), v.stride(1))
        cache_strides = (*key_cache.stride()[:3], *value_cache.stride()[:3])
        k_out_strides = (0, 0)
    else:
        key_cache = value_cache = v = length = k_out
        length_stride, v_strides, cache_strides = 0, (0, 0), (0,) * 6
        k_out_strides = (k_out.stride(0), k_out.stride(1))
    _rotary_kernel[(B, Hq + Hkv)](
        q, k, v, cos, sin, q_out, k_out if k_out is not None else q_out, key_cache, value_cache, length,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides,
        _row_stride(cos, "cos", B, D), _row_stride(sin, "sin", B, D),
        q_out.stride(0), q_out.stride(1), *k_out_strides, *cache_strides, length_stride,
        Hq, D // 2, INTO_CACHE=into_cache, BLOCK_HALF=triton.next_power_of_2(D // 2),
    )
    return q_out


def rotary_qk_triton(q, k, cos, sin):
    """The Triton path of :func:`rotary_qk`."""
    k_out = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    return _launch(q, k, None, cos, sin, None, None, None, k_out), k_out


def rotary_qk_into_cache_triton(q, k, v, cos, sin, key_cache, value_cache, length):
    """The Triton path of :func:`rotary_qk_into_cache`."""
    return _launch(q, k, v, cos, sin, key_cache, value_cache, length, None)


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of one token's queries and keys: ``q [B, Hq, D]``, ``k [B, Hkv, D]`` (heads may be strided
    views), ``cos, sin [B, D]`` or ``[B, 1, D]`` (B or 1 rows) -> (``[B, Hq, D]``, ``[B, Hkv, D]``). Triton or
    ``reference.rotary_qk_ref``, as ``retrofit.kernels.backend`` picks for the device."""
    return implementation("rotary_qk", q.device)(q, k, cos, sin)


def rotary_qk_into_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         key_cache: torch.Tensor, value_cache: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Rotate one token's ``q [B, Hq, D]`` and ``k [B, Hkv, D]``; write the rotated key and ``v [B, Hkv, D]`` at
    position ``length - 1`` of each row of ``key_cache, value_cache [B, Hkv, N, D]`` (in place; ``length`` int, one
    element or ``[B]``, the cache length counting this token, read on the device) -> rotated q ``[B, Hq, D]``.
    Triton or ``reference.rotary_qk_into_cache_ref``, as ``retrofit.kernels.backend`` picks for the device."""
    return implementation("rotary_qk_into_cache", q.device)(q, k, v, cos, sin, key_cache, value_cache, length)
