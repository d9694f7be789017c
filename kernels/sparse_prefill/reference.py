"""Pure-PyTorch reference of block-sparse prefill attention (same math as the Triton kernel, no fusion).

It defines the semantics ``attention.py`` must match and is the CPU execution path. Conventions:

- a prefill chunk of ``T`` queries ``q [B, Hq, T, D]`` over ``N`` keys ``k, v [B, Hkv, N, D]`` (the keys written so
  far, the chunk's own last): query ``i`` sits at key position ``q_offset + i`` (default ``N - T``) and sees the
  keys at positions ``kv_start[b] <= pos <= q_offset + i`` (causal; left padding lies before ``kv_start``);
- GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``; every query head has its own selection;
- blocks are ``block_size`` consecutive positions, counted from position 0 for queries and keys alike: query block
  ``q_offset // block_size + m`` is row ``m`` of the selection, and its entries are key-block ids;
- a selection is ``indices [B, Hq, M, S]`` (int, distinct ids per row, any order) with ``counts [B, Hq, M]`` valid
  entries per row (entries past the count are ignored), ``M = ceil((q_offset + T) / block_size) - q_offset //
  block_size`` rows.
"""
from __future__ import annotations

import math

import torch


def query_block_count(q_offset: int, T: int, block_size: int) -> int:
    """Rows ``M`` of a selection: the blocks of ``block_size`` positions that the positions ``[q_offset, q_offset +
    T)`` touch."""
    return math.ceil((q_offset + T) / block_size) - q_offset // block_size


def sparse_prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    kv_start: torch.Tensor,
    block_size: int,
    q_offset: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention of a prefill chunk over the selected key blocks only.

    q [B, Hq, T, D], k/v [B, Hkv, N, D], indices [B, Hq, M, S], counts [B, Hq, M], kv_start [B] (see the module
    docstring) -> o [B, T, Hq, D] in q's dtype (fp32 math; the layout transformers' attention functions return). A
    query with no valid key among its selected blocks gives zeros. One query block at a time: the selected blocks'
    keys are gathered and every query of the block attends over them with the causal and padding masks.
    """
    B, Hq, T, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    group = Hq // Hkv
    q_offset = N - T if q_offset is None else int(q_offset)
    scale = D**-0.5 if scale is None else scale
    first_block = q_offset // block_size
    head_of = torch.arange(Hq, device=q.device) // group
    keys, values = k.float()[:, head_of], v.float()[:, head_of]  # [B, Hq, N, D]
    start = kv_start.long().to(q.device)[:, None, None, None]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float32, device=q.device)
    for row in range(indices.shape[2]):
        lo = max((first_block + row) * block_size, q_offset)
        hi = min((first_block + row + 1) * block_size, q_offset + T)
        width = int(counts[:, :, row].max()) if counts.numel() else 0
        if lo >= hi or width == 0:
            continue
        blocks = indices[:, :, row, :width].long()  # [B, Hq, S]
        positions = (blocks[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(2)
        listed = torch.arange(width, device=q.device).repeat_interleave(block_size) < counts[:, :, row, None].long()
        usable = listed & (positions >= start[..., 0]) & (positions < N)  # [B, Hq, L]
        positions = torch.where(usable, positions, torch.zeros_like(positions))
        gather = positions[..., None].expand(-1, -1, -1, D)
        block_keys, block_values = keys.gather(2, gather), values.gather(2, gather)  # [B, Hq, L, D]
        query_positions = torch.arange(lo, hi, device=q.device)
        queries = q[:, :, lo - q_offset: hi - q_offset].float()  # [B, Hq, R, D]
        scores = torch.einsum("bhrd,bhld->bhrl", queries, block_keys) * scale
        visible = usable[:, :, None, :] & (positions[:, :, None, :] <= query_positions[None, None, :, None])
        scores = scores.masked_fill(~visible, float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        weights = torch.exp(scores - row_max)
        denom = weights.sum(-1, keepdim=True)
        rows_out = torch.einsum("bhrl,bhld->bhrd", weights, block_values) / torch.where(denom > 0, denom, 1.0)
        out[:, lo - q_offset: hi - q_offset] = rows_out.transpose(1, 2)
    return out.to(q.dtype)


def dense_prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_start: torch.Tensor,
                                q_offset: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention with the same conventions (every key block selected), through SDPA with an explicit
    mask: q [B, Hq, T, D], k/v [B, Hkv, N, D], kv_start [B] -> o [B, T, Hq, D] (rows without a valid key: zeros)."""
    B, Hq, T, D = q.shape
    N = k.shape[2]
    q_offset = N - T if q_offset is None else int(q_offset)
    query_positions = torch.arange(q_offset, q_offset + T, device=q.device)
    key_positions = torch.arange(N, device=q.device)
    visible = (key_positions[None, None, :] <= query_positions[None, :, None]) \
        & (key_positions[None, None, :] >= kv_start.long().to(q.device)[:, None, None])  # [B, T, N]
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible[:, None],
                                                           scale=scale, enable_gqa=True)
    out = out.masked_fill(~visible.any(-1)[:, None, :, None], 0.0)
    return out.transpose(1, 2).to(q.dtype)
