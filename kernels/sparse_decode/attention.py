"""Triton sparse-decode attention: one decode token attends to the selected blocks of the KV cache.

Shared by every sparse method (StreamingLLM, Quest, ClusterKV, RetrievalAttention, SeerAttention): they differ only in
how they pick ``indices``. One program handles all ``G`` query heads of a kv head (GQA: the selected keys are read
once per group) for one split of the selection (flash-decoding); a second small kernel merges the splits.
Online softmax in fp32, exp2 domain; logit softcapping (Gemma 2: ``softcap * tanh(logit / softcap)`` before the
softmax) where asked. Semantics: ``reference.sparse_decode_attention_ref``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..backend import implementation
from ..online_softmax import online_softmax_step
from ..device import multiprocessors

_LOG2E = 1.4426950408889634


@triton.jit
def _sparse_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, count_ptr, start_ptr, end_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ib, stride_ih,
    stride_cb, stride_start, stride_end,
    Hkv, D, tokens_per_split, qk_scale, softcap,
    SOFTCAP: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // Hkv
    hkv = pid_bh % Hkv

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + (hkv * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)

    count = tl.load(count_ptr + b * stride_cb + hkv)
    kv_start = tl.load(start_ptr + b * stride_start)
    kv_end = tl.load(end_ptr + b * stride_end)
    total = count * BLOCK_SIZE
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, total)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    idx_base = idx_ptr + b * stride_ib + hkv * stride_ih
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    for first in range(lo, hi, BLOCK_N):
        j = first + tl.arange(0, BLOCK_N)
        in_list = j < hi
        block = tl.load(idx_base + j // BLOCK_SIZE, mask=in_list, other=0)
        pos = block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
        ok = in_list & (pos >= kv_start) & (pos < kv_end)
        pos = tl.where(ok, pos, 0)
        k = tl.load(k_base + pos[:, None] * stride_kn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAP:  # qk_scale is the natural-log scale here: cap the logit, then move to the exp2 domain
            s = _capped(s * qk_scale, softcap) * 1.4426950408889634
        else:
            s = s * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.load(v_base + pos[:, None] * stride_vn + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE)

    head = b * (Hkv * GROUP) + hkv * GROUP + g
    part = head * NUM_SPLITS + split
    tl.store(part_m_ptr + part, m_i, mask=g_ok)
    tl.store(part_l_ptr + part, l_i, mask=g_ok)
    tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _capped(x, cap):
    """``cap * tanh(x / cap)``, with tanh from one exp2 of a non-positive argument (no overflow)."""
    y = x / cap
    t = tl.exp2(-2.8853900817779268 * tl.abs(y))  # exp(-2|y|)
    magnitude = (1.0 - t) / (1.0 + t)
    return cap * tl.where(y < 0, -magnitude, magnitude)


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, o_ptr, stride_ob, stride_oh, Hq, D,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    b = head // Hq
    h = head % Hq
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < D
    m = tl.load(part_m_ptr + head * NUM_SPLITS + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + head * NUM_SPLITS + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (head * NUM_SPLITS + s)[:, None] * D + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)
    denom = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def _default_splits(rows: int, max_tokens: int, block_n: int, device: torch.device) -> int:
    sms = multiprocessors(device)
    if sms is None:
        return 1
    programs_wanted = 2 * sms
    splits = max(1, math.ceil(programs_wanted / max(rows, 1)))
    return max(1, min(splits, math.ceil(max_tokens / block_n), 64))


def bounds_as_read(bounds: torch.Tensor) -> torch.Tensor:
    """kv_start / kv_end [B] as the kernel reads them: int32 or int64 as given (a static cache's int64 length
    counter, expanded to the rows with stride 0, is read in place: no conversion kernel), other dtypes as int32."""
    return bounds if bounds.dtype in (torch.int32, torch.int64) else bounds.to(torch.int32)


def sparse_decode_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    kv_start: torch.Tensor,
    kv_end: torch.Tensor,
    block_size: int = 1,
    scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one decode token over the selected blocks of the cache: the Triton path of
    :func:`sparse_decode_attention`.

    q [B, Hq, D]; k, v [B, Hkv, N, D] (last dim contiguous); indices [B, Hkv, S] int (block ids of ``block_size``
    positions); counts [B, Hkv] int (valid entries per row, ragged); kv_start, kv_end [B] int (valid positions
    ``kv_start <= pos < kv_end``; any stride, e.g. one counter expanded). Returns o [B, Hq, D] in q's dtype; rows
    with nothing valid give zeros. ``softcap``: logits capped as ``softcap * tanh(logit / softcap)`` (None: not).
    ``num_splits`` splits each row's selection over that many programs (default: fill the GPU; 1 on CPU).
    """
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dimension")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k and v must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    indices = indices.to(torch.int32)
    counts = counts.to(torch.int32).contiguous()
    kv_start, kv_end = bounds_as_read(kv_start), bounds_as_read(kv_end)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    block_n = block_n or (64 if block_size <= 64 else 128)
    max_tokens = max(indices.shape[-1] * block_size, 1)
    splits = num_splits or _default_splits(B * Hkv, max_tokens, block_n, q.device)
    tokens_per_split = math.ceil(math.ceil(max_tokens / splits) / block_n) * block_n
    part_m = torch.empty(B * Hq * splits, device=q.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(B * Hq * splits, D, device=q.device, dtype=torch.float32)
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    block_d = triton.next_power_of_2(D)
    _sparse_decode_split_kernel[(B * Hkv, splits)](
        q, k, v, indices, counts, kv_start, kv_end, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        indices.stride(0), indices.stride(1), counts.stride(0), kv_start.stride(0), kv_end.stride(0),
        Hkv, D, tokens_per_split, scale if softcap else scale * _LOG2E, float(softcap or 1.0),
        SOFTCAP=bool(softcap), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=splits, IEEE=q.dtype == torch.float32,
    )
    _merge_splits_kernel[(B * Hq,)](
        part_m, part_l, part_acc, out, out.stride(0), out.stride(1), Hq, D,
        NUM_SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d,
    )
    return out


def sparse_decode_attention(q, k, v, indices, counts, kv_start, kv_end, block_size=1, scale=None, softcap=None,
                            **launch):
    """Attention of one decode token over the selected blocks of the cache.

    q [B, Hq, D]; k, v [B, Hkv, N, D]; indices [B, Hkv, S] block ids of ``block_size`` positions; counts [B, Hkv]
    valid entries per row; kv_start, kv_end [B] (valid positions ``kv_start <= pos < kv_end``) -> o [B, Hq, D] in
    q's dtype. ``softcap``: logits capped as ``softcap * tanh(logit / softcap)`` before the softmax (None: not). Triton (:func:`sparse_decode_attention_triton`) or ``reference.sparse_decode_attention_ref``, as
    ``retrofit.kernels.backend`` picks for q's device; ``launch`` (``num_splits``, ``block_n``) tunes the Triton
    launch and is not used by the PyTorch path.
    """
    run = implementation("sparse_decode_attention", q.device)
    tuning = launch if run is sparse_decode_attention_triton else {}
    return run(q, k, v, indices, counts, kv_start, kv_end, block_size=block_size, scale=scale, softcap=softcap,
               **tuning)
