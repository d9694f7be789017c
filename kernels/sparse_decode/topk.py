"""Triton top-k selection for the per-step block scores: one program per row, exact radix select in registers.

The k-th largest score is found bit by bit (32 counting passes over the row held in registers, floats mapped to
order-preserving unsigned keys), then the positions above it (plus the lowest-positioned ties) are written in ascending
order with a prefix sum. Rows up to MAX_ROW scores; longer rows fall back to the reference (a stable sort).
Semantics: ``reference.topk_indices_ref`` (same tie rule, so results are identical).

``block_topk`` is the same selection over the blocks of a static cache buffer with the methods' two overrides applied
as the scores are loaded (blocks without a valid position of the row at -inf, the newest block at +inf): one launch
where the overrides written as tensor operations were about ten small kernels per layer and decode step.
Semantics: ``reference.block_topk_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation
from .attention import bounds_as_read
from .reference import block_topk_ref, topk_indices_ref

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
def _topk_kernel(scores_ptr, out_ptr, start_ptr, end_ptr, stride_s, stride_o, stride_start, stride_end, P, k,
                 rows_per_batch, block_size, BLOCK: tl.constexpr, BLOCK_OVERRIDES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < P
    score = tl.load(scores_ptr + row * stride_s + offs, mask=ok, other=0.0).to(tl.float32)
    if BLOCK_OVERRIDES:
        b = row // rows_per_batch
        kv_start = tl.load(start_ptr + b * stride_start).to(tl.int64)
        kv_end = tl.load(end_ptr + b * stride_end).to(tl.int64)
        first = offs.to(tl.int64) * block_size
        empty = (first + block_size <= kv_start) | (first >= kv_end)
        score = tl.where(empty, float("-inf"), score)
        score = tl.where(offs.to(tl.int64) == (kv_end - 1) // block_size, float("inf"), score)
    key = _order_key(score)
    threshold = tl.zeros([], dtype=tl.uint32)
    for bit in tl.static_range(32):
        candidate = threshold | (tl.full([], 1, tl.uint32) << (31 - bit))
        count = tl.sum((ok & (key >= candidate)).to(tl.int32), 0)
        threshold = tl.where(count >= k, candidate, threshold)
    _store_selected(out_ptr + row * stride_o, offs, ok, key, threshold, k)


def _launch_topk(scores: torch.Tensor, k: int, kv_start: torch.Tensor | None, kv_end: torch.Tensor | None,
                 rows_per_batch: int, block_size: int) -> torch.Tensor:
    R, P = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(R, k, device=scores.device, dtype=torch.int32)
    overrides = kv_start is not None
    start = bounds_as_read(kv_start) if overrides else out  # unread without the overrides
    end = bounds_as_read(kv_end) if overrides else out
    block = max(16, triton.next_power_of_2(P))
    _topk_kernel[(R,)](scores, out, start, end, scores.stride(0), out.stride(0), start.stride(0), end.stride(0), P, k,
                       rows_per_batch, block_size, BLOCK=block, BLOCK_OVERRIDES=overrides,
                       num_warps=8 if block >= 4096 else 4)
    return out


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
    return _launch_topk(scores, k, None, None, 1, 1)


def block_topk_triton(scores: torch.Tensor, k: int, kv_start: torch.Tensor, kv_end: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """The ``k`` best blocks of each row, the newest always among them: the Triton path of :func:`block_topk`.

    scores [B, Hkv, P] fp32 (not modified), kv_start/kv_end [B] int (any stride), 1 <= k <= P -> indices [B, Hkv, k]
    int32.
    """
    B, H, P = scores.shape
    if not 1 <= k <= P:
        raise ValueError(f"k={k} must be in [1, {P}]")
    if P > MAX_ROW:
        return block_topk_ref(scores, k, kv_start, kv_end, block_size)
    rows = scores.reshape(B * H, P)
    return _launch_topk(rows, k, kv_start, kv_end, H, block_size).view(B, H, k)


def topk_indices(scores, k):
    """scores [R, P] (fp32) -> the positions of each row's ``k`` largest scores [R, k] int32, ascending; ties go to the
    lower position. Triton or ``reference.topk_indices_ref`` (identical results), as the backend picks."""
    return implementation("topk_indices", scores.device)(scores, k)


def block_topk(scores, k, kv_start, kv_end, block_size):
    """scores [B, Hkv, P] of the P blocks of ``block_size`` positions of a static buffer, kv_start/kv_end [B] -> the
    ``k`` best blocks of each row [B, Hkv, k] int32, ascending, with blocks holding no valid position at -inf and the
    block of position ``kv_end - 1`` at +inf (always chosen). Triton or ``reference.block_topk_ref``."""
    return implementation("block_topk", scores.device)(scores, k, kv_start, kv_end, block_size)
