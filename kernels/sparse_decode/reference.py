"""Pure-PyTorch references for the sparse-decode kernels (same math, no fusion).

They define the semantics the Triton kernels in ``attention.py`` and ``scoring.py`` must match, and they are the
CPU execution path (Triton runs on CPU only through its interpreter, far too slow for end-to-end generation).

Conventions shared by every function here:

- one decode token per sequence: ``q [B, Hq, D]``;
- the cache ``k, v [B, Hkv, N, D]`` (``N`` is the buffer capacity, at least the valid length);
- the valid key positions of row ``b`` are ``kv_start[b] <= pos < kv_end[b]`` (left padding is before ``kv_start``);
- GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)``; the ``G = Hq // Hkv`` heads of a group share one selection;
- a selection is ``indices [B, Hkv, S]`` (int) of *blocks* of ``block_size`` consecutive positions (``block_size=1``:
  single tokens; ``block_size=page_size``: Quest pages) with ``counts [B, Hkv]`` valid entries per row (ragged).
"""
from __future__ import annotations

import torch


def selected_positions(
    indices: torch.Tensor, counts: torch.Tensor, block_size: int, kv_start: torch.Tensor, kv_end: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand block indices to key positions.

    indices [B, Hkv, S], counts [B, Hkv], kv_start/kv_end [B] -> (positions [B, Hkv, S*block_size] long,
    valid [B, Hkv, S*block_size] bool). Invalid entries have position 0.
    """
    B, Hkv, S = indices.shape
    offsets = torch.arange(block_size, device=indices.device)
    positions = (indices.long()[..., None] * block_size + offsets).reshape(B, Hkv, S * block_size)
    entry = torch.arange(S, device=indices.device).repeat_interleave(block_size)
    valid = entry < counts.long()[..., None]
    valid &= positions >= kv_start.long()[:, None, None]
    valid &= positions < kv_end.long()[:, None, None]
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


def sparse_decode_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    kv_start: torch.Tensor,
    kv_end: torch.Tensor,
    block_size: int = 1,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention of one decode token over the selected positions only.

    q [B, Hq, D], k/v [B, Hkv, N, D], indices [B, Hkv, S], counts [B, Hkv], kv_start/kv_end [B] -> o [B, Hq, D]
    (dtype of q; fp32 math). A row with no valid position gives zeros. ``softcap``: the logits ``scale * q . k``
    become ``softcap * tanh(logit / softcap)`` before the softmax (Gemma 2); None leaves them.
    """
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    positions, valid = selected_positions(indices, counts, block_size, kv_start, kv_end)
    gather = positions[..., None].expand(-1, -1, -1, D)
    keys = torch.gather(k, 2, gather).float()  # [B, Hkv, L, D]
    values = torch.gather(v, 2, gather).float()
    queries = q.float().view(B, Hkv, group, D)
    scores = torch.einsum("bhgd,bhld->bhgl", queries, keys) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(-1, keepdim=True)
    out = torch.einsum("bhgl,bhld->bhgd", weights, values) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.reshape(B, Hq, D).to(q.dtype)


def quest_page_scores_ref(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, num_pages: int, kv_start: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Quest's upper bound of ``q . k`` over each page, maxed over the query heads of a GQA group.

    q [B, Hq, D], page_min/page_max [B, Hkv, P, D] (P >= num_pages) -> scores [B, Hkv, num_pages] fp32, with
    ``score = sum_d max(q_d * max_d, q_d * min_d)``; pages that end at or before ``kv_start[b]`` (all padding) get -inf.
    """
    B, Hq, D = q.shape
    Hkv = page_min.shape[1]
    queries = q.float().view(B, Hkv, Hq // Hkv, 1, D)
    upper = torch.maximum(queries * page_max[:, :, None, :num_pages].float(),
                          queries * page_min[:, :, None, :num_pages].float()).sum(-1)
    scores = upper.amax(2)
    page_end = (torch.arange(num_pages, device=q.device) + 1) * page_size
    padding_only = page_end[None, :] <= kv_start.long()[:, None]
    return scores.masked_fill(padding_only[:, None, :], float("-inf"))


def cluster_scores_ref(q: torch.Tensor, centroids: torch.Tensor, num_clusters: int,
                       scale: float = 1.0) -> torch.Tensor:
    """``scale * q . centroid`` maxed over the query heads of a GQA group (``scale`` > 0).

    q [B, Hq, D], centroids [B, Hkv, C, D] (C >= num_clusters) -> scores [B, Hkv, num_clusters] fp32.
    """
    B, Hq, D = q.shape
    Hkv = centroids.shape[1]
    queries = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhgd,bhcd->bhgc", queries, centroids[:, :, :num_clusters].float()).amax(2)
    return scores if scale == 1.0 else scores * scale


def topk_indices_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest scores of each row, ascending; ties go to the lower position.

    scores [R, P] fp32 (k <= P) -> indices [R, k] int32.
    """
    order = torch.sort(-scores.float(), dim=-1, stable=True).indices[:, :k]
    return order.sort(dim=-1).values.to(torch.int32)


def block_topk_ref(scores: torch.Tensor, k: int, kv_start: torch.Tensor, kv_end: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    """The ``k`` best blocks of each row of a static buffer, the newest always among them.

    scores [B, Hkv, P] fp32 of the P blocks of ``block_size`` positions, kv_start/kv_end [B] -> indices [B, Hkv, k]
    int32, ascending, as :func:`topk_indices_ref` picks them after two overrides: a block holding no valid position
    of its row (it ends at or before ``kv_start`` or starts at or after ``kv_end``) scores -inf, then the block
    holding position ``kv_end - 1`` (the decoded token) scores +inf, as in the authors' Quest and SeerAttention kernels
    (top-k over the other blocks, the newest appended). ``scores`` is left as it is.
    """
    B, H, P = scores.shape
    first = torch.arange(P, device=scores.device) * block_size
    start, end = kv_start.long()[:, None], kv_end.long()[:, None]
    empty = (first[None, :] + block_size <= start) | (first[None, :] >= end)  # [B, P]
    masked = scores.float().masked_fill(empty[:, None, :], float("-inf"))
    newest = ((end - 1) // block_size)[:, None, :].expand(-1, H, 1)  # [B, Hkv, 1]
    masked = masked.scatter(2, newest, float("inf"))
    return topk_indices_ref(masked.reshape(B * H, P), k).view(B, H, k)


def page_bounds(keys: torch.Tensor, valid: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page metadata: keys [B, H, L, D] with L a multiple of page_size, valid [B, L] bool -> (min, max)
    [B, H, L/page_size, D] in the keys' dtype, element-wise over the valid keys of each page (0 for a page without
    any)."""
    B, H, L, D = keys.shape
    pages = keys.view(B, H, L // page_size, page_size, D)
    ok = valid.view(B, 1, L // page_size, page_size, 1)
    low = torch.where(ok, pages, float("inf")).amin(3)
    high = torch.where(ok, pages, float("-inf")).amax(3)
    return torch.where(torch.isinf(low), 0, low), torch.where(torch.isinf(high), 0, high)


def _newest_block(keys: torch.Tensor, write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block of ``block_size`` positions holding ``write_pos - 1``: (its index [1], its keys [B, H, block_size, D],
    valid [B, block_size]: the positions with ``kv_start[b] <= pos < kv_end[b]``)."""
    N = keys.shape[2]
    block = (write_pos.long() - 1) // block_size  # [1]
    positions = block * block_size + torch.arange(block_size, device=keys.device)  # [block_size]
    valid = (positions[None, :] >= kv_start.long()[:, None]) & (positions[None, :] < kv_end.long()[:, None])
    return block, keys.index_select(2, positions.clamp(max=N - 1)), valid  # beyond N never valid


def quest_page_update_ref(keys: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                          write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                          page_size: int) -> None:
    """:func:`page_bounds` of the page holding the token just written at ``write_pos - 1``, written in place.

    keys [B, Hkv, N, D], page_min/page_max [B, Hkv, P, D] (P pages of ``page_size`` cover N), write_pos [1] long (the
    same position for every row: a static cache's decode step), kv_start/kv_end [B] -> page_min/page_max of that page
    set to the element-wise min and max over its keys at valid positions ``kv_start[b] <= pos < kv_end[b]`` (0 where
    a row has none there).
    """
    page, span, valid = _newest_block(keys, write_pos, kv_start, kv_end, page_size)
    low, high = page_bounds(span, valid, page_size)
    page_min.index_copy_(2, page, low.to(page_min.dtype))
    page_max.index_copy_(2, page, high.to(page_max.dtype))


def pool_blocks(keys: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """SeerAttention's pooled block keys: keys [B, H, L, D] with L a multiple of block_size, valid [B, L] bool ->
    [B, H, L/block_size, 3D] fp32 (max, min, mean over the valid keys of each block; zeros for a block without any)."""
    B, H, L, D = keys.shape
    blocks = keys.float().view(B, H, L // block_size, block_size, D)
    ok = valid.view(B, 1, L // block_size, block_size, 1)
    big = torch.finfo(torch.float32).max
    kmax = torch.where(ok, blocks, -big).amax(3)
    kmin = torch.where(ok, blocks, big).amin(3)
    count = ok.sum(3)
    kmean = torch.where(ok, blocks, 0.0).sum(3) / count.clamp(min=1)
    empty = count == 0
    return torch.cat([kmax.masked_fill(empty, 0), kmin.masked_fill(empty, 0), kmean], -1)


def pool_newest_block_ref(keys: torch.Tensor, write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                          block_size: int) -> torch.Tensor:
    """:func:`pool_blocks` of the one block holding the token just written at ``write_pos - 1``.

    keys [B, Hkv, N, D], write_pos [1] long (the same position for every row), kv_start/kv_end [B] -> [B, Hkv, 1, 3D]
    fp32 (max, min, mean over the block's valid keys ``kv_start[b] <= pos < kv_end[b]``; zeros where there are none).
    """
    _, span, valid = _newest_block(keys, write_pos, kv_start, kv_end, block_size)
    return pool_blocks(span, valid, block_size)


def seer_gate_key_update_ref(keys: torch.Tensor, gate_keys: torch.Tensor, weight: torch.Tensor,
                             write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                             block_size: int) -> None:
    """SeerAttention's gate key of the block holding position ``write_pos - 1``, in place: its
    :func:`pool_newest_block_ref` in the gate keys' dtype, projected by ``weight``, written into that block.

    keys [B, Hkv, N, D], gate_keys [B, Hkv, NB, hidden], weight [hidden, 3D], write_pos [1] long, kv_start/kv_end [B].
    """
    pooled = pool_newest_block_ref(keys, write_pos, kv_start, kv_end, block_size).to(gate_keys.dtype)
    block = (write_pos.long() - 1) // block_size
    gate_keys.index_copy_(2, block, torch.nn.functional.linear(pooled, weight))


def fixed_bounds(kv_start: torch.Tensor, kv_end: torch.Tensor, clustered_upto: torch.Tensor, budget: int,
                 n_sink: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a ClusterKV step reads whatever the clusters: kv_start/kv_end [B] (each row's valid positions),
    clustered_upto [1] long (positions before it are clustered) -> (start, end, sinks_end, recent_from) [B, 1] long:
    the sinks are [start, sinks_end) (the row's first ``n_sink`` valid positions), the recent tokens [recent_from,
    end): the unclustered ones, or the newest ``budget - n_sink`` where more are unclustered."""
    start, end = kv_start.long()[:, None], kv_end.long()[:, None]
    sinks_end = torch.minimum(start + n_sink, end)
    recent_from = torch.maximum(clustered_upto, end - (budget - n_sink))
    return start, end, sinks_end, recent_from


def fixed_positions(kv_start: torch.Tensor, kv_end: torch.Tensor, clustered_upto: torch.Tensor, budget: int,
                    n_sink: int, N: int) -> torch.Tensor:
    """The positions of :func:`fixed_bounds` among N: [B, N] bool."""
    start, end, sinks_end, recent_from = fixed_bounds(kv_start, kv_end, clustered_upto, budget, n_sink)
    pos = torch.arange(N, device=kv_start.device)
    return (pos >= start) & (pos < end) & ((pos < sinks_end) | (pos >= recent_from))


def fixed_count(kv_start: torch.Tensor, kv_end: torch.Tensor, clustered_upto: torch.Tensor, budget: int,
                n_sink: int) -> torch.Tensor:
    """How many positions :func:`fixed_positions` holds, [B, 1] long, counted from the bounds: the sinks, then the
    recent tokens past them."""
    start, end, sinks_end, recent_from = fixed_bounds(kv_start, kv_end, clustered_upto, budget, n_sink)
    return (sinks_end - start) + (end - torch.maximum(recent_from, sinks_end)).clamp(min=0)


def cluster_take_ref(scores: torch.Tensor, sizes: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                     clustered_upto: torch.Tensor, budget: int, n_sink: int) -> torch.Tensor:
    """The clusters a ClusterKV step reads: scores [B, Hkv, C] fp32, sizes [B, Hkv, C] int32 (0: an empty slot, never
    ranked ahead of a cluster) -> taken [B, Hkv, C] bool: best score first (ties: the lower slot first), each cluster
    taken while the sizes so far fit in the room the row's :func:`fixed_count` leaves of ``budget``."""
    room = (budget - fixed_count(kv_start, kv_end, clustered_upto, budget, n_sink))[:, None, :]  # [B, 1, 1]
    ranked = scores.float().masked_fill(sizes == 0, float("-inf"))
    order = torch.argsort(ranked, dim=-1, descending=True, stable=True)
    taken_in_order = torch.cumsum(sizes.long().gather(-1, order), -1) <= room
    return torch.zeros_like(taken_in_order).scatter_(-1, order, taken_in_order)


def cluster_token_mask_ref(assign: torch.Tensor, taken: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                           clustered_upto: torch.Tensor, budget: int, n_sink: int) -> torch.Tensor:
    """ClusterKV's token mask of a decode step: assign [B, Hkv, N] int32 (cluster of each position, -1: not
    clustered), taken [B, Hkv, C] bool -> [B, Hkv, N] bool, the positions of taken clusters or of
    :func:`fixed_positions`."""
    chosen = taken.gather(-1, assign.long().clamp(min=0)) & (assign >= 0)
    fixed = fixed_positions(kv_start, kv_end, clustered_upto, budget, n_sink, assign.shape[-1])
    return chosen | fixed[:, None, :]


def mask_positions_ref(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A token mask as a fixed-width list of positions: mask [R, N] bool -> (positions [R, width'] int32, counts [R]
    int32), width' = min(width, N) (at least 1). Each row lists its masked positions in ascending order, then its
    other positions in ascending order, cut at width'; counts = masked positions, at most width'."""
    width = max(1, min(width, mask.shape[-1]))
    counts = mask.sum(-1, dtype=torch.int32).clamp_(max=width)
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :width]
    return order.to(torch.int32), counts
