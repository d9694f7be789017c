"""Small helpers shared by the methods: growing metadata buffers and turning token masks into selections."""
from __future__ import annotations

import torch

from retrofit.kernels.sparse_decode import topk_indices
from retrofit.sparse.contract import Selection


def grown(buffer: torch.Tensor | None, dim: int, needed: int, like: torch.Tensor, shape: tuple[int, ...],
          fill: float | int = 0) -> torch.Tensor:
    """Return ``buffer`` with at least ``needed`` entries along ``dim`` (geometric growth, new entries = ``fill``).

    ``shape`` is the full shape with the growing dim set to anything; ``like`` gives dtype and device.
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


def positions(layer) -> torch.Tensor:
    """[length] long positions of the written part of a layer's buffer."""
    return torch.arange(layer.length, device=layer.keys.device)


def mask_to_selection(mask: torch.Tensor) -> Selection:
    """Token mask [B, Hkv, N] bool -> Selection of single tokens (ragged counts, ascending positions)."""
    counts = mask.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()), 1)
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)[..., :width]
    return Selection(order.to(torch.int32), counts, 1)


def all_blocks(layer, block_size: int = 16) -> Selection:
    """Every written block of the buffer (the kernel masks positions outside [kv_start, kv_end))."""
    B, Hkv = layer.keys.shape[:2]
    blocks = -(-layer.length // block_size)
    indices = torch.arange(blocks, device=layer.keys.device, dtype=torch.int32).expand(B, Hkv, blocks)
    counts = torch.full((B, Hkv), blocks, device=layer.keys.device, dtype=torch.int32)
    return Selection(indices, counts, block_size)


def sink_mask(layer, n_sink: int) -> torch.Tensor:
    """[B, N] bool: the first ``n_sink`` valid positions of each row."""
    pos = positions(layer)
    start = layer.kv_start.long()[:, None]
    return (pos >= start) & (pos < start + n_sink)


def full_counts(layer, top: torch.Tensor) -> torch.Tensor:
    """[B, Hkv] int32 filled with ``top.shape[2]`` (cached per layer: no allocation on the steady decode path)."""
    cached = layer.meta.get("_full_counts")
    if cached is None or cached[0] != top.shape[2] or cached[1].shape != top.shape[:2]:
        cached = (top.shape[2], torch.full(top.shape[:2], top.shape[2], dtype=torch.int32, device=top.device))
        layer.meta["_full_counts"] = cached
    return cached[1]


def best_blocks(layer, scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, Hkv, P] -> the k best block ids per row [B, Hkv, k] int32 (ascending).

    Block P - 1, the one being written (it holds the token being decoded), is always among them, as in the
    authors' Quest and SeerAttention kernels (top-k over the other blocks, the last appended). ``scores`` is
    overwritten there.
    """
    B, H, P = scores.shape
    scores[:, :, P - 1] = float("inf")
    return topk_indices(scores.reshape(B * H, P), k).view(B, H, k)
