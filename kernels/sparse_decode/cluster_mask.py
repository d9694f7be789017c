"""Triton kernel that builds ClusterKV's token mask for one decode step: the positions of the clusters the step took,
plus the sinks and the recent, not yet clustered tokens. One program per (row, block of positions) reads each
position's cluster id and looks its cluster up in the taken flags; it replaces about ten element-wise kernels over
the whole buffer per layer (an int64 copy of the ids, a gather, comparisons and ors). Semantics:
``reference.cluster_token_mask_ref`` (identical output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

MASK_BLOCK = 1024


@triton.jit
def _cluster_token_mask_kernel(assign_ptr, taken_ptr, kv_start_ptr, kv_end_ptr, recent_from_ptr, out_ptr,
                               stride_a, stride_t, stride_start, stride_end, stride_recent, stride_o, heads, N,
                               n_sink, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    batch = row // heads
    start = tl.load(kv_start_ptr + batch * stride_start).to(tl.int64)
    end = tl.load(kv_end_ptr + batch * stride_end).to(tl.int64)
    recent_from = tl.load(recent_from_ptr + batch * stride_recent).to(tl.int64)
    pos = block * BLOCK + tl.arange(0, BLOCK)
    inside = pos < N
    cluster = tl.load(assign_ptr + row * stride_a + pos, mask=inside, other=-1)
    clustered = inside & (cluster >= 0)
    taken = tl.load(taken_ptr + row * stride_t + tl.maximum(cluster, 0), mask=clustered, other=0) != 0
    fixed = (pos >= start) & (pos < end) & ((pos < start + n_sink) | (pos >= recent_from))
    tl.store(out_ptr + row * stride_o + pos, ((clustered & taken) | fixed).to(tl.uint8), mask=inside)


def cluster_token_mask_triton(assign: torch.Tensor, taken: torch.Tensor, kv_start: torch.Tensor,
                              kv_end: torch.Tensor, recent_from: torch.Tensor, n_sink: int) -> torch.Tensor:
    """The Triton path of :func:`cluster_token_mask` (same arguments, same result)."""
    B, H, N = assign.shape
    if assign.stride(-1) != 1:
        assign = assign.contiguous()
    taken = taken.contiguous().view(torch.uint8)  # the same bytes; a byte pointer rather than a 1-bit one
    recent_from = recent_from.reshape(B)
    mask = torch.empty(B, H, N, device=assign.device, dtype=torch.bool)
    rows_a, rows_t, rows_o = assign.view(B * H, N), taken.view(B * H, -1), mask.view(torch.uint8).view(B * H, N)
    block = min(MASK_BLOCK, max(16, triton.next_power_of_2(N)))
    _cluster_token_mask_kernel[(B * H, triton.cdiv(N, block))](
        rows_a, rows_t, kv_start, kv_end, recent_from, rows_o, rows_a.stride(0), rows_t.stride(0), kv_start.stride(0),
        kv_end.stride(0), recent_from.stride(0), rows_o.stride(0), H, N, n_sink, BLOCK=block)
    return mask


def cluster_token_mask(assign, taken, kv_start, kv_end, recent_from, n_sink):
    """ClusterKV's token mask of a decode step.

    assign [B, Hkv, N] int32 (each position's cluster, -1: not clustered), taken [B, Hkv, C] bool (the clusters the
    step reads), kv_start/kv_end [B] (the row's valid positions), recent_from [B, 1] int64 (the first recent position
    read exactly), n_sink -> mask [B, Hkv, N] bool: positions of taken clusters, plus the valid positions among the
    first ``n_sink`` of their row or at or after ``recent_from``. Triton or ``reference.cluster_token_mask_ref``
    (identical results).
    """
    return implementation("cluster_token_mask", assign.device)(assign, taken, kv_start, kv_end, recent_from, n_sink)
