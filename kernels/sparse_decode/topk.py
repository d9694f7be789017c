"""Triton top-k selection for the per-step block scores: one program per row, exact radix select in registers.

The k-th largest score is found bit by bit (32 counting passes over the row held in registers, floats mapped to
order-preserving unsigned keys), then the positions above it (plus the lowest-positioned ties) are written in ascending
order with a prefix sum. Rows up to MAX_ROW scores; longer rows fall back to the reference (a stable sort).
Semantics: ``reference.topk_indices_ref`` (same tie rule, so results are identical).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from retrofit.kernels.sparse_decode.reference import topk_indices_ref

MAX_ROW = 16384
BITS_PER_PASS = 1  # 1 or 4: see topk_indices; benchmarks/sparse_decode.py times both


@triton.jit
def _order_key(x):
    """fp32 -> uint32 with the same order (-0.0 ranks equal to +0.0, as in the reference)."""
    x = x.to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | (-2147483647 - 1)  # negative floats: flip all bits; others: set the sign bit
    return (bits ^ flip).to(tl.uint32, bitcast=True)


@triton.jit
def _store_selected(out_row, offs, ok, key, threshold, k):
    """Write, in ascending order, the positions with key > threshold plus the lowest-positioned ties up to k."""
    above = ok & (key > threshold)
    ties = ok & (key == threshold)
    room = k - tl.sum(above.to(tl.int32), 0)
    chosen = above | (ties & (tl.cumsum(ties.to(tl.int32), 0) <= room))
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out_row + slot, offs, mask=chosen)


@triton.jit
def _topk_kernel(scores_ptr, out_ptr, stride_s, stride_o, P, k, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < P
    key = _order_key(tl.load(scores_ptr + row * stride_s + offs, mask=ok, other=0.0))
    threshold = tl.zeros([], dtype=tl.uint32)
    for bit in tl.static_range(32):
        candidate = threshold | (tl.full([], 1, tl.uint32) << (31 - bit))
        count = tl.sum((ok & (key >= candidate)).to(tl.int32), 0)
        threshold = tl.where(count >= k, candidate, threshold)
    _store_selected(out_ptr + row * stride_o, offs, ok, key, threshold, k)


@triton.jit
def _topk_nibble_kernel(scores_ptr, out_ptr, stride_s, stride_o, P, k, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """The same selection, 4 bits of the threshold per pass: 8 passes instead of 32, each counting the row against
    the 16 candidate nibbles at once ([CHUNK, 16] compares accumulated over the row, one reduction per pass)."""
    row = tl.program_id(0)
    base = scores_ptr + row * stride_s
    nibbles = tl.arange(0, 16).to(tl.uint32)
    threshold = tl.zeros([], dtype=tl.uint32)
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        candidates = threshold | (nibbles << shift)
        hits = tl.zeros([CHUNK, 16], dtype=tl.int32)
        for first in range(0, P, CHUNK):
            offs = first + tl.arange(0, CHUNK)
            ok = offs < P
            key = _order_key(tl.load(base + offs, mask=ok, other=0.0))
            hits += (ok[:, None] & (key[:, None] >= candidates[None, :])).to(tl.int32)
        counts = tl.sum(hits, 0)
        # candidate 0 is the threshold itself (count >= k by induction): the new nibble is the last one that keeps k
        nibble = tl.sum((counts >= k).to(tl.int32), 0) - 1
        threshold = threshold | (nibble.to(tl.uint32) << shift)
    offs = tl.arange(0, BLOCK)
    ok = offs < P
    key = _order_key(tl.load(base + offs, mask=ok, other=0.0))
    _store_selected(out_ptr + row * stride_o, offs, ok, key, threshold, k)


def topk_indices(scores: torch.Tensor, k: int, bits_per_pass: int | None = None) -> torch.Tensor:
    """Positions of the ``k`` largest scores of each row, ascending; ties go to the lower position (Triton).

    scores [R, P] (fp32, no NaN; -inf allowed), 1 <= k <= P -> indices [R, k] int32.
    ``bits_per_pass``: 1 (32 counting passes over the row in registers) or 4 (8 passes, 16 candidates each);
    default ``BITS_PER_PASS``.
    """
    R, P = scores.shape
    if not 1 <= k <= P:
        raise ValueError(f"k={k} must be in [1, {P}]")
    if P > MAX_ROW:
        return topk_indices_ref(scores, k)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(R, k, device=scores.device, dtype=torch.int32)
    block = max(16, triton.next_power_of_2(P))
    bits = bits_per_pass or BITS_PER_PASS
    if bits == 4:
        _topk_nibble_kernel[(R,)](scores, out, scores.stride(0), out.stride(0), P, k, BLOCK=block,
                                  CHUNK=min(block, 512), num_warps=8 if block >= 4096 else 4)
    elif bits == 1:
        _topk_kernel[(R,)](scores, out, scores.stride(0), out.stride(0), P, k, BLOCK=block,
                           num_warps=8 if block >= 4096 else 4)
    else:
        raise ValueError(f"bits_per_pass must be 1 or 4, got {bits}")
    return out
