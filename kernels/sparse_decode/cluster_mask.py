"""Triton kernels of ClusterKV's decode-step selection after the cluster scores: which clusters the step takes, and
the token mask they give with the sinks and recent tokens. ``cluster_take`` ranks each row's clusters by score and
takes them while their sizes fit in the budget: for every cluster it sums the sizes of the clusters ranked at or
before it (a pairwise count over the row's few hundred clusters, no sort; one program per row and block of 64
clusters, each reading the whole row: C^2 comparisons a row, ~1.4M at a thousand clusters), which replaces a sort, a
gather, a prefix sum, a scatter and the room's arithmetic. ``cluster_token_mask`` reads each position's cluster id and looks its
cluster up in the taken flags: it replaces about ten element-wise kernels over the whole buffer per layer. Both
compute the sinks' and recent tokens' bounds from the row's counters. Semantics: ``reference.cluster_take_ref`` and
``reference.cluster_token_mask_ref`` (identical output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

MASK_BLOCK = 1024
TAKE_BLOCK = 64


@triton.jit
def _fixed_bounds(kv_start_ptr, kv_end_ptr, clustered_upto_ptr, row, heads, stride_start, stride_end, budget, n_sink):
    """(start, end, sinks_end, recent_from) of the batch row that (batch, kv head) row ``row`` belongs to, as
    ``reference.fixed_bounds``."""
    batch = row // heads
    start = tl.load(kv_start_ptr + batch * stride_start).to(tl.int64)
    end = tl.load(kv_end_ptr + batch * stride_end).to(tl.int64)
    sinks_end = tl.minimum(start + n_sink, end)
    recent_from = tl.maximum(tl.load(clustered_upto_ptr).to(tl.int64), end - (budget - n_sink))
    return start, end, sinks_end, recent_from


@triton.jit
def _ranked(scores_ptr, sizes_ptr, slots, C):
    """(score, size) of the cluster slots ``slots`` of a row; an empty slot (size 0) or one past C scores -inf."""
    size = tl.load(sizes_ptr + slots, mask=slots < C, other=0)
    score = tl.load(scores_ptr + slots, mask=slots < C, other=float("-inf"))
    return tl.where(size == 0, float("-inf"), score), size


@triton.jit
def _cluster_take_kernel(scores_ptr, sizes_ptr, kv_start_ptr, kv_end_ptr, clustered_upto_ptr, taken_ptr,
                         stride_s, stride_z, stride_start, stride_end, stride_t, heads, C, budget, n_sink,
                         BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    start, end, sinks_end, recent_from = _fixed_bounds(kv_start_ptr, kv_end_ptr, clustered_upto_ptr, row, heads,
                                                       stride_start, stride_end, budget, n_sink)
    room = budget - (sinks_end - start) - tl.maximum(end - tl.maximum(recent_from, sinks_end), 0)
    offs = tl.arange(0, BLOCK)
    row_scores, row_sizes = scores_ptr + row * stride_s, sizes_ptr + row * stride_z
    mine = block * BLOCK + offs
    score, _ = _ranked(row_scores, row_sizes, mine, C)
    ahead = tl.zeros([BLOCK], dtype=tl.int64)  # sizes of the clusters ranked at or before each of mine
    for other_first in range(0, C, BLOCK):
        other = other_first + offs
        other_score, other_size = _ranked(row_scores, row_sizes, other, C)
        before = (other_score[None, :] > score[:, None]) | (
            (other_score[None, :] == score[:, None]) & (other[None, :] <= mine[:, None]))
        ahead += tl.sum(tl.where(before, other_size[None, :].to(tl.int64), 0), 1)
    tl.store(taken_ptr + row * stride_t + mine, (ahead <= room).to(tl.uint8), mask=mine < C)


@triton.jit
def _cluster_token_mask_kernel(assign_ptr, taken_ptr, kv_start_ptr, kv_end_ptr, clustered_upto_ptr, out_ptr,
                               stride_a, stride_t, stride_start, stride_end, stride_o, heads, N, budget, n_sink,
                               BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    start, end, sinks_end, recent_from = _fixed_bounds(kv_start_ptr, kv_end_ptr, clustered_upto_ptr, row, heads,
                                                       stride_start, stride_end, budget, n_sink)
    pos = block * BLOCK + tl.arange(0, BLOCK)
    inside = pos < N
    cluster = tl.load(assign_ptr + row * stride_a + pos, mask=inside, other=-1)
    clustered = inside & (cluster >= 0)
    taken = tl.load(taken_ptr + row * stride_t + tl.maximum(cluster, 0), mask=clustered, other=0) != 0
    fixed = (pos >= start) & (pos < end) & ((pos < sinks_end) | (pos >= recent_from))
    tl.store(out_ptr + row * stride_o + pos, ((clustered & taken) | fixed).to(tl.uint8), mask=inside)


def cluster_take_triton(scores: torch.Tensor, sizes: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                        clustered_upto: torch.Tensor, budget: int, n_sink: int) -> torch.Tensor:
    """The Triton path of :func:`cluster_take` (same arguments, same result)."""
    B, H, C = scores.shape
    scores, sizes = scores.contiguous().view(B * H, C), sizes.contiguous().view(B * H, C)
    taken = torch.empty(B, H, C, device=scores.device, dtype=torch.bool)
    rows_t = taken.view(torch.uint8).view(B * H, C)
    block = min(TAKE_BLOCK, max(16, triton.next_power_of_2(C)))
    _cluster_take_kernel[(B * H, triton.cdiv(C, block))](
        scores, sizes, kv_start, kv_end, clustered_upto, rows_t, scores.stride(0), sizes.stride(0),
        kv_start.stride(0), kv_end.stride(0), rows_t.stride(0), H, C, budget, n_sink, BLOCK=block)
    return taken


def cluster_token_mask_triton(assign: torch.Tensor, taken: torch.Tensor, kv_start: torch.Tensor,
                              kv_end: torch.Tensor, clustered_upto: torch.Tensor, budget: int,
                              n_sink: int) -> torch.Tensor:
    """The Triton path of :func:`cluster_token_mask` (same arguments, same result)."""
    B, H, N = assign.shape
    if assign.stride(-1) != 1:
        assign = assign.contiguous()
    taken = taken.contiguous().view(torch.uint8)  # the same bytes; a byte pointer rather than a 1-bit one
    mask = torch.empty(B, H, N, device=assign.device, dtype=torch.bool)
    rows_a, rows_t, rows_o = assign.view(B * H, N), taken.view(B * H, -1), mask.view(torch.uint8).view(B * H, N)
    block = min(MASK_BLOCK, max(16, triton.next_power_of_2(N)))
    _cluster_token_mask_kernel[(B * H, triton.cdiv(N, block))](
        rows_a, rows_t, kv_start, kv_end, clustered_upto, rows_o, rows_a.stride(0), rows_t.stride(0),
        kv_start.stride(0), kv_end.stride(0), rows_o.stride(0), H, N, budget, n_sink, BLOCK=block)
    return mask


def cluster_take(scores, sizes, kv_start, kv_end, clustered_upto, budget, n_sink):
    """The clusters a ClusterKV decode step reads.

    scores [B, Hkv, C] fp32 (``cluster_scores``), sizes [B, Hkv, C] int32 (0: an empty slot), kv_start/kv_end [B]
    (each row's valid positions), clustered_upto [1] long (positions before it are clustered), budget, n_sink ->
    taken [B, Hkv, C] bool: clusters by best score (ties: the lower slot first), taken while their sizes so far fit in
    what the sinks and recent tokens (``reference.fixed_bounds``) leave of ``budget``. Triton or
    ``reference.cluster_take_ref`` (identical results).
    """
    return implementation("cluster_take", scores.device)(scores, sizes, kv_start, kv_end, clustered_upto, budget,
                                                         n_sink)


def cluster_token_mask(assign, taken, kv_start, kv_end, clustered_upto, budget, n_sink):
    """ClusterKV's token mask of a decode step.

    assign [B, Hkv, N] int32 (each position's cluster, -1: not clustered), taken [B, Hkv, C] bool (``cluster_take``),
    kv_start/kv_end [B], clustered_upto [1] long, budget, n_sink -> mask [B, Hkv, N] bool: positions of taken
    clusters, plus the sinks and recent tokens of ``reference.fixed_bounds``. Triton or
    ``reference.cluster_token_mask_ref`` (identical results).
    """
    return implementation("cluster_token_mask", assign.device)(assign, taken, kv_start, kv_end, clustered_upto,
                                                               budget, n_sink)
