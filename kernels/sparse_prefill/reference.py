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


# The reference's largest fp32 intermediate, in bytes: it computes the strided logits in slices of query blocks
# below it.
ESTIMATE_BYTES = 256 * 1024 ** 2


def antidiagonal_block_mass_ref(
    runs_q: torch.Tensor,
    runs_k: torch.Tensor,
    kv_start: torch.Tensor,
    runs_per_block: int,
    stride: int,
    first_run: int,
    q_offset: int,
    T: int,
    logit_scale: float,
) -> torch.Tensor:
    """XAttention's block mass before its normalisation per query block, from the runs of ``stride`` positions.

    runs_q [B, Hq, Rq, E]: query run ``first_run + r`` (absolute: positions ``[(first_run + r) * stride, ...)``) as
    one vector of its ``stride`` queries read backwards (E = stride * head_dim; zeros outside the chunk or in the
    padding); runs_k [B, Hkv, Rk, E]: key run ``c`` (positions ``[c * stride, ...)``) read forwards; kv_start [B] the
    first valid key of each row; ``runs_per_block``: runs per block (block_size / stride) -> [B, Hq, Rq /
    runs_per_block, Rk / runs_per_block] fp32: for each block pair, the sum over its query runs of the softmax
    weights (over the key runs each query run sees: causal, in the row's real tokens, the query run inside the chunk
    ``[q_offset, q_offset + T)``) of its key runs, the logits being ``runs_q . runs_k * logit_scale``. A query run
    seeing nothing adds 0. GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``. fp32 math, in slices of query
    blocks under :data:`ESTIMATE_BYTES` of intermediates.
    """
    B, Hq, Rq, E = runs_q.shape
    Hkv, Rk = runs_k.shape[1], runs_k.shape[2]
    group, per_block, S = Hq // Hkv, runs_per_block, stride
    device = runs_q.device
    start = kv_start.long().to(device)
    query_run = torch.arange(Rq, device=device) + first_run
    key_run = torch.arange(Rk, device=device)
    in_chunk = ((query_run + 1) * S > q_offset) & (query_run * S < q_offset + T)
    visible = (key_run[None, None, :] <= query_run[None, :, None]) & in_chunk[None, :, None] \
        & ((key_run[None, None, :] + 1) * S > start[:, None, None]) \
        & ((query_run[None, :, None] + 1) * S > start[:, None, None])  # [B, Rq, Rk]
    queries = runs_q.float().reshape(B, Hkv, group, Rq, E)
    keys = runs_k.float()
    rows, key_blocks = Rq // per_block, Rk // per_block
    mass = torch.zeros(B, Hq, rows, key_blocks, device=device, dtype=torch.float32)
    step = max(1, ESTIMATE_BYTES // max(4 * B * Hq * per_block * Rk * 2, 1))
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        runs = slice(lo * per_block, hi * per_block)
        # causal: no key run after the slice's last query run is visible to it (a whole number of blocks)
        key_runs = min(Rk, first_run + hi * per_block)
        logits = torch.einsum("bhgrx,bhcx->bhgrc", queries[:, :, :, runs], keys[:, :, :key_runs])
        logits = logits.reshape(B, Hq, -1, key_runs) * logit_scale
        logits = logits.masked_fill(~visible[:, None, runs, :key_runs], float("-inf"))
        weights = torch.softmax(logits, -1).nan_to_num(0.0)  # a run with nothing visible: zeros
        blocks = weights.view(B, Hq, hi - lo, per_block, key_runs // per_block, per_block).sum((3, 5))
        mass[:, :, lo:hi, : key_runs // per_block] = blocks
    return mass
