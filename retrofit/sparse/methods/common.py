"""Small helpers shared by the methods: metadata buffers, fixed-shape selections and the masks they start from.

Everything a decode step uses here has a shape fixed by the layer's capacity and the budget and reads the valid
range of each row from device tensors (``kv_start``, ``kv_end``), so a step issues the same operations every time
and never reads a tensor value on the host. Constant tensors (position ranges, all-block selections) are built once
per layer and capacity and kept in ``layer.meta`` under names starting with ``_``.
"""
from __future__ import annotations

import torch

from retrofit.kernels.sparse_decode import block_topk, mask_positions
from retrofit.sparse.contract import Selection


def grown(buffer: torch.Tensor | None, dim: int, needed: int, like: torch.Tensor, shape: tuple[int, ...],
          fill: float | int = 0) -> torch.Tensor:
    """Return ``buffer`` with at least ``needed`` entries along ``dim`` (geometric growth, new entries = ``fill``).

    ``shape`` is the full shape with the growing dim set to anything; ``like`` gives dtype and device. A static
    cache sizes its buffers for the whole generation at the prefill, so they never grow while decoding.
    """
    have = 0 if buffer is None else buffer.shape[dim]
    if needed <= have:
        return buffer
    size = list(shape)
    size[dim] = max(needed, 2 * have, 16)
    fresh = torch.full(size, fill, dtype=like.dtype, device=like.device)
    if buffer is not None:
        fresh.narrow(dim, 0, have).copy_(buffer)
    return fresh


def _constant(layer, name: str, build) -> torch.Tensor:
    """A tensor that depends only on the layer's shape and capacity, built once per capacity."""
    key = (name, layer.capacity, tuple(layer.keys.shape[:2]))
    cached = layer.meta.get("_" + name)
    if cached is None or cached[0] != key:
        cached = (key, build())
        layer.meta["_" + name] = cached
    return cached[1]


def blocks_written(layer, start: int, end: int, block_size: int) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """The whole blocks of ``block_size`` positions that positions [start, end) of the buffer touch, for a method's
    metadata after a prefill chunk: (their block range, keys [B, Hkv, L, D] zero-padded to whole blocks, valid [B, L]:
    the positions with ``kv_start[b] <= pos < end``)."""
    first, last = start // block_size, -(-end // block_size)
    span = layer.keys[:, :, first * block_size : end]
    span = torch.nn.functional.pad(span, (0, 0, 0, (last - first) * block_size - span.shape[2]))
    pos = torch.arange(first * block_size, last * block_size, device=span.device)
    valid = (pos[None, :] >= layer.kv_start.long()[:, None]) & (pos[None, :] < end)
    return slice(first, last), span, valid


def mask_to_selection(mask: torch.Tensor, width: int) -> Selection:
    """Token mask [B, Hkv, N] bool -> a Selection of single tokens of fixed ``width`` (ascending positions first;
    counts [B, Hkv] = tokens in the mask, at most ``width``: the caller's budget bounds them): one
    :func:`~retrofit.kernels.sparse_decode.mask_positions`."""
    B, H, N = mask.shape
    indices, counts = mask_positions(mask.reshape(B * H, N), width)
    return Selection(indices.view(B, H, -1), counts.view(B, H), 1)


def all_blocks(layer, block_size: int = 16) -> Selection:
    """Every block of the buffer (the kernel skips positions outside [kv_start, kv_end)): a dense step."""
    def build() -> Selection:
        B, Hkv = layer.keys.shape[:2]
        blocks = -(-layer.capacity // block_size)
        indices = torch.arange(blocks, device=layer.keys.device, dtype=torch.int32).expand(B, Hkv, blocks)
        counts = torch.full((B, Hkv), blocks, device=layer.keys.device, dtype=torch.int32)
        return Selection(indices.contiguous(), counts, block_size)

    return _constant(layer, f"all_blocks_{block_size}", build)


def full_counts(layer, top: torch.Tensor) -> torch.Tensor:
    """[B, Hkv] int32 filled with ``top.shape[2]`` (built once per layer: no allocation on the decode path)."""
    return _constant(layer, f"full_counts_{top.shape[2]}",
                     lambda: torch.full(top.shape[:2], top.shape[2], dtype=torch.int32, device=top.device))


def best_blocks(layer, scores: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """scores [B, Hkv, P] of the P blocks of the buffer -> the k best block ids per row [B, Hkv, k] int32
    (ascending). Blocks that hold no valid position of a row (left padding only, or not yet written) are never
    chosen ahead of the others, and the block being written (it holds the decoded token) is always chosen, as in the
    authors' Quest and SeerAttention kernels (top-k over the other blocks, the last one appended): one
    :func:`~retrofit.kernels.sparse_decode.block_topk`."""
    return block_topk(scores, k, layer.kv_start, layer.kv_end, block_size)
