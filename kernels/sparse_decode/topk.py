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

from ..backend import implementation
from .reference import topk_indices_ref

MAX_ROW = 16384


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


def topk_indices_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest scores of each row, ascending; ties go to the lower position: the Triton path
    of :func:`topk_indices`.

    scores [R, P] (fp32, no NaN; -inf allowed), 1 <= k <= P -> indices [R, k] int32.
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
    _topk_kernel[(R,)](scores, out, scores.stride(0), out.stride(0), P, k, BLOCK=block,
                       num_warps=8 if block >= 4096 else 4)
    return out


def topk_indices(scores, k):
    """scores [R, P] (fp32) -> the positions of each row's ``k`` largest scores [R, k] int32, ascending; ties go to the
    lower position. Triton or ``reference.topk_indices_ref`` (identical results), as the backend picks."""
    return implementation("topk_indices", scores.device)(scores, k)
