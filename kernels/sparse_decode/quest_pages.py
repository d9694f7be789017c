"""Triton kernel for Quest's per-step metadata upkeep: the min and max keys of the page the decoded token joined.

One program per (row, kv head) reads that page's ``page_size`` keys once and writes both bounds; written as tensor
operations the same update was about twenty small kernels per layer and decode step (the page's positions, their
validity, the masked min and max, the empty-page zeros, two scatters). Semantics: ``reference.quest_page_update_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation
from .attention import bounds_as_read


@triton.jit
def _quest_page_update_kernel(
    keys_ptr, min_ptr, max_ptr, write_pos_ptr, start_ptr, end_ptr,
    stride_kb, stride_kh, stride_kn,
    stride_mb, stride_mh, stride_mp,
    stride_xb, stride_xh, stride_xp,
    stride_start, stride_end,
    Hkv, N, D, page_size,
    PAGE_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // Hkv
    h = pid % Hkv
    page = (tl.load(write_pos_ptr).to(tl.int64) - 1) // page_size
    kv_start = tl.load(start_ptr + b * stride_start).to(tl.int64)
    kv_end = tl.load(end_ptr + b * stride_end).to(tl.int64)
    offs = tl.arange(0, PAGE_PAD)
    pos = page * page_size + offs
    valid = (offs < page_size) & (pos >= kv_start) & (pos < kv_end) & (pos < N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tile_ok = valid[:, None] & d_ok[None, :]
    keys = tl.load(keys_ptr + b * stride_kb + h * stride_kh + pos[:, None] * stride_kn + d[None, :],
                   mask=tile_ok, other=0.0).to(tl.float32)
    low = tl.min(tl.where(tile_ok, keys, float("inf")), 0)
    high = tl.max(tl.where(tile_ok, keys, float("-inf")), 0)
    any_valid = tl.sum(valid.to(tl.int32), 0) > 0
    low = tl.where(any_valid, low, 0.0)
    high = tl.where(any_valid, high, 0.0)
    tl.store(min_ptr + b * stride_mb + h * stride_mh + page * stride_mp + d,
             low.to(min_ptr.dtype.element_ty), mask=d_ok)
    tl.store(max_ptr + b * stride_xb + h * stride_xh + page * stride_xp + d,
             high.to(max_ptr.dtype.element_ty), mask=d_ok)


def quest_page_update_triton(keys: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                             write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                             page_size: int) -> None:
    """Quest's metadata of the page holding position ``write_pos - 1``, in place: the Triton path of
    :func:`quest_page_update`.

    keys [B, Hkv, N, D], page_min/page_max [B, Hkv, P, D] (last dims contiguous), write_pos [1] int,
    kv_start/kv_end [B] int (any stride).
    """
    B, Hkv, N, D = keys.shape
    if keys.stride(-1) != 1 or page_min.stride(-1) != 1 or page_max.stride(-1) != 1:
        raise ValueError("the keys and the page metadata need a contiguous last dimension")
    if page_min.shape[:2] != (B, Hkv) or page_max.shape != page_min.shape or page_min.shape[-1] != D:
        raise ValueError(f"page metadata of shape {tuple(page_min.shape)} does not fit keys {tuple(keys.shape)}")
    kv_start, kv_end = bounds_as_read(kv_start), bounds_as_read(kv_end)
    _quest_page_update_kernel[(B * Hkv,)](
        keys, page_min, page_max, write_pos, kv_start, kv_end,
        keys.stride(0), keys.stride(1), keys.stride(2),
        page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2),
        kv_start.stride(0), kv_end.stride(0),
        Hkv, N, D, page_size,
        PAGE_PAD=max(16, triton.next_power_of_2(page_size)), BLOCK_D=triton.next_power_of_2(D),
    )


def quest_page_update(keys, page_min, page_max, write_pos, kv_start, kv_end, page_size):
    """keys [B, Hkv, N, D], page_min/page_max [B, Hkv, P, D], write_pos [1], kv_start/kv_end [B] -> None: the min and
    max over the valid keys of the page holding position ``write_pos - 1`` written into that page of
    page_min/page_max (0 where a row has no valid key there). Triton or ``reference.quest_page_update_ref``."""
    implementation("quest_page_update", keys.device)(keys, page_min, page_max, write_pos, kv_start, kv_end, page_size)
