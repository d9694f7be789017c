"""Triton block-sparse prefill attention: a prefill chunk attends only to the key blocks selected for each query
block and head; unselected blocks are never loaded.

One program computes one query block (``block_size`` positions) of one (batch row, query head): it walks the
``counts`` entries of its row of ``indices`` and runs flash attention's online softmax (fp32, exp2 domain) over
those key blocks, with the causal mask and the row's left padding applied per element (so a block straddling the
diagonal or the padding is exact). GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``. The output is written
as ``[B, T, Hq, D]``, the layout transformers' attention functions return. Semantics:
``reference.sparse_prefill_attention_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation
from ..online_softmax import online_softmax_step
from .reference import query_block_count

_LOG2E = 1.4426950408889634


@triton.jit
def _block_sparse_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, idx_ptr, count_ptr, start_ptr,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_ot, stride_oh,
    stride_ib, stride_ih, stride_im,
    stride_cb, stride_ch, stride_start,
    Hq, T, N, D, q_offset, first_block, qk_scale,
    ROWS, GROUP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):
    program = tl.program_id(0)
    heads = tl.num_programs(0) // ROWS  # batch rows x query heads
    bh = program % heads
    row = ROWS - 1 - program // heads  # every head's last query block first: see the launch below
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    hkv = h // GROUP

    positions = (first_block + row) * BLOCK + tl.arange(0, BLOCK)  # the query block's positions
    i = positions - q_offset  # their rows in the chunk
    q_ok = (i >= 0) & (i < T)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + i.to(tl.int64)[:, None] * stride_qt + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)

    count = tl.load(count_ptr + b * stride_cb + h * stride_ch + row)
    kv_start = tl.load(start_ptr + b * stride_start)
    idx_row = idx_ptr + b * stride_ib + h * stride_ih + row * stride_im
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    for entry in range(0, count):
        block = tl.load(idx_row + entry)
        keys = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        k_ok = (keys >= kv_start) & (keys < N)
        k = tl.load(k_base + keys[:, None] * stride_kn + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        visible = k_ok[None, :] & (keys[None, :] <= positions[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        v = tl.load(v_base + keys[:, None] * stride_vn + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ob + i.to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


def sparse_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    kv_start: torch.Tensor,
    block_size: int,
    q_offset: int | None = None,
    scale: float | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The Triton path of :func:`sparse_prefill_attention`: q [B, Hq, T, D], k/v [B, Hkv, N, D] (last dims
    contiguous, any other strides), indices [B, Hq, M, S], counts [B, Hq, M], kv_start [B] -> o [B, T, Hq, D].
    ``block_size``: a power of two, at least 16 (the tile of ``tl.dot``)."""
    B, Hq, T, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two of at least 16, got {block_size}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dimension")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k and v must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    q_offset = N - T if q_offset is None else int(q_offset)
    rows = query_block_count(q_offset, T, block_size)
    if indices.shape[:3] != (B, Hq, rows) or counts.shape != (B, Hq, rows):
        raise ValueError(f"a selection of {(B, Hq, rows)} query blocks is needed, got indices "
                         f"{tuple(indices.shape)} and counts {tuple(counts.shape)}")
    scale = D**-0.5 if scale is None else scale
    indices = indices.to(torch.int32)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    counts = counts.to(torch.int32)
    kv_start = kv_start.to(device=q.device, dtype=torch.int32)
    out = torch.empty(B, T, Hq, D, device=q.device, dtype=q.dtype)
    if T == 0 or rows == 0:
        return out
    block_d = max(16, triton.next_power_of_2(D))
    if num_warps is None:
        # 128 x 128 tiles: 8 warps took 0.55-0.60x the time of Triton's default 4 on an H100 (Llama-3-8B's heads at
        # 8K-127K, 10-13% of the blocks: benchmarks/sparse_prefill_parts.py, 2026-12-07)
        num_warps = 8 if block_size >= 128 else 4
    # Every head's last query block starts first and the first block last: a row's key blocks grow with its
    # position and the call's last row computes all of them (``last_query_blocks``), so launched first row first the
    # longest rows would start last and run on alone after the rest (longest first keeps the GPU's SMs evenly busy).
    _block_sparse_prefill_kernel[(rows * B * Hq,)](
        q, k, v, out, indices, counts, kv_start,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        indices.stride(0), indices.stride(1), indices.stride(2), counts.stride(0), counts.stride(1),
        kv_start.stride(0),
        Hq, T, N, D, q_offset, q_offset // block_size, scale * _LOG2E, rows,
        GROUP=Hq // Hkv, BLOCK=block_size, BLOCK_D=block_d, IEEE=q.dtype == torch.float32, num_warps=num_warps,
    )
    return out


def sparse_prefill_attention(q, k, v, indices, counts, kv_start, block_size, q_offset=None, scale=None, **launch):
    """Causal attention of a prefill chunk over the selected key blocks of each query block and head.

    q [B, Hq, T, D]; k, v [B, Hkv, N, D] (the keys written so far, the chunk's last); indices [B, Hq, M, S] key-block
    ids of ``block_size`` positions, distinct per row; counts [B, Hq, M] valid entries per row; kv_start [B] first
    valid key of each row (left padding before it); ``q_offset``: key position of the first query (default
    ``N - T``) -> o [B, T, Hq, D] in q's dtype. Query block ``m`` of the selection covers the positions
    ``[(q_offset // block_size + m) * block_size, ...)``; M = ``query_block_count(q_offset, T, block_size)``.
    Triton (:func:`sparse_prefill_attention_triton`) or ``reference.sparse_prefill_attention_ref``, as
    ``retrofit.kernels.backend`` picks for q's device; ``launch`` (``num_warps``) tunes the Triton launch only.
    """
    run = implementation("sparse_prefill_attention", q.device)
    tuning = launch if run is sparse_prefill_attention_triton else {}
    return run(q, k, v, indices, counts, kv_start, block_size, q_offset=q_offset, scale=scale, **tuning)
