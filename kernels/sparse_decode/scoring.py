"""Triton kernels for the per-step block scoring of the sparse methods.

- ``quest_page_scores``: Quest's upper bound ``sum_d max(q_d*max_d, q_d*min_d)`` per page from the page min/max
  metadata, written as ``relu(q) . max + min(q, 0) . min`` so that it runs as two tensor-core dots;
- ``cluster_scores``: ``q . centroid`` per cluster (ClusterKV) or per block gate key (SeerAttention, with the gate's
  ``1/sqrt(hidden)`` as ``scale``).

Both reduce over the ``G`` query heads of a GQA group with a max (one selection per kv head), read the metadata
once per group, and write fp32 scores. Semantics: ``reference.quest_page_scores_ref`` / ``cluster_scores_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation


@triton.jit
def _group_scores_kernel(
    q_ptr, upper_ptr, lower_ptr, start_ptr, out_ptr,
    stride_qb, stride_qh,
    stride_ub, stride_uh, stride_up,
    stride_lb, stride_lh, stride_lp,
    stride_ob, stride_oh,
    Hkv, D, num_blocks, block_size, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    BOUNDS: tl.constexpr, IEEE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // Hkv
    hkv = pid_bh % Hkv
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < num_blocks
    g_ok = g < GROUP
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + (hkv * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    tile_ok = p_ok[:, None] & d_ok[None, :]
    upper = tl.load(upper_ptr + b * stride_ub + hkv * stride_uh + p[:, None] * stride_up + d[None, :],
                    mask=tile_ok, other=0.0)
    if BOUNDS:
        lower = tl.load(lower_ptr + b * stride_lb + hkv * stride_lh + p[:, None] * stride_lp + d[None, :],
                        mask=tile_ok, other=0.0)
        q_pos = tl.maximum(q, 0.0).to(upper.dtype)
        q_neg = tl.minimum(q, 0.0).to(upper.dtype)
        if IEEE:
            s = tl.dot(q_pos, tl.trans(upper), input_precision="ieee")
            s += tl.dot(q_neg, tl.trans(lower), input_precision="ieee")
        else:
            s = tl.dot(q_pos, tl.trans(upper))
            s += tl.dot(q_neg, tl.trans(lower))
    else:
        if IEEE:
            s = tl.dot(q.to(upper.dtype), tl.trans(upper), input_precision="ieee")
        else:
            s = tl.dot(q.to(upper.dtype), tl.trans(upper))
    s = tl.where(g_ok[:, None], s * scale, float("-inf"))
    best = tl.max(s, 0)
    if BOUNDS:
        kv_start = tl.load(start_ptr + b)
        best = tl.where((p + 1) * block_size <= kv_start, float("-inf"), best)
    tl.store(out_ptr + b * stride_ob + hkv * stride_oh + p, best, mask=p_ok)


def _launch(q, upper, lower, kv_start, num_blocks, block_size, bounds, scale=1.0):
    B, Hq, D = q.shape
    Hkv = upper.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if upper.dtype != lower.dtype or upper.shape[-1] != D:
        raise ValueError("the block metadata must share one dtype and the head dim of q")
    if q.stride(-1) != 1 or upper.stride(-1) != 1 or lower.stride(-1) != 1:
        raise ValueError("q and the block metadata need a contiguous last dimension")
    group = Hq // Hkv
    out = torch.empty(B, Hkv, num_blocks, device=q.device, dtype=torch.float32)
    if num_blocks == 0:
        return out
    block_p = 64
    _group_scores_kernel[(B * Hkv, triton.cdiv(num_blocks, block_p))](
        q, upper, lower, kv_start, out,
        q.stride(0), q.stride(1), upper.stride(0), upper.stride(1), upper.stride(2),
        lower.stride(0), lower.stride(1), lower.stride(2), out.stride(0), out.stride(1),
        Hkv, D, num_blocks, block_size, scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_P=block_p,
        BLOCK_D=triton.next_power_of_2(D), BOUNDS=bounds, IEEE=upper.dtype == torch.float32,
    )
    return out


def quest_page_scores_triton(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, num_pages: int, kv_start: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Quest page scores: the Triton path of :func:`quest_page_scores`.

    q [B, Hq, D], page_min/page_max [B, Hkv, P, D] (P >= num_pages, last dim contiguous), kv_start [B] int
    -> scores [B, Hkv, num_pages] fp32; pages made only of left padding (end <= kv_start) get -inf.
    """
    kv_start = kv_start.to(torch.int32).contiguous()
    return _launch(q, page_max, page_min, kv_start, num_pages, page_size, True)


def cluster_scores_triton(q: torch.Tensor, centroids: torch.Tensor, num_clusters: int,
                          scale: float = 1.0) -> torch.Tensor:
    """``scale * q . centroid`` maxed over each GQA group: the Triton path of :func:`cluster_scores`.

    q [B, Hq, D], centroids [B, Hkv, C, D] (C >= num_clusters) -> scores [B, Hkv, num_clusters] fp32.
    """
    if scale <= 0:
        raise ValueError(f"scale must be positive (the max over a group is taken after it), got {scale}")
    # without bounds the kernel reads no kv_start: q stands in for it, where a fresh tensor would cost a kernel
    return _launch(q, centroids, centroids, q, num_clusters, 1, False, scale)


def quest_page_scores(q, page_min, page_max, num_pages, kv_start, page_size):
    """Quest page scores: q [B, Hq, D], page_min/page_max [B, Hkv, P, D], kv_start [B] -> [B, Hkv, num_pages] fp32
    (``sum_d max(q_d max_d, q_d min_d)``, max over the GQA group; pages of left padding only get -inf)."""
    return implementation("quest_page_scores", q.device)(q, page_min, page_max, num_pages, kv_start, page_size)


def cluster_scores(q, centroids, num_clusters, scale=1.0):
    """``scale * q . centroid`` maxed over each GQA group (``scale`` > 0): q [B, Hq, D], centroids [B, Hkv, C, D] ->
    [B, Hkv, num_clusters] fp32."""
    return implementation("cluster_scores", q.device)(q, centroids, num_clusters, scale)
