"""Triton kernel that turns a token mask into a fixed-width list of positions (stream compaction): the selection
ClusterKV and RetrievalAttention hand to the sparse attention. One program per row scans the mask twice in blocks,
a prefix sum placing each position; the stable sort it replaces ran over every position of the buffer, per layer and
decode step. Semantics: ``reference.mask_positions_ref`` (identical output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

SCAN_BLOCK = 1024


@triton.jit
def _mask_positions_kernel(mask_ptr, out_ptr, count_ptr, stride_m, stride_o, N, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    row_mask = mask_ptr + row * stride_m
    total = tl.zeros([], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        total += tl.sum(tl.load(row_mask + start + offs, mask=start + offs < N, other=0).to(tl.int32), 0)
    masked_before = tl.zeros([], dtype=tl.int32)
    other_before = tl.zeros([], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        pos = start + offs
        inside = pos < N
        masked = tl.load(row_mask + pos, mask=inside, other=0).to(tl.int32)
        other = inside.to(tl.int32) - masked
        slot = tl.where(masked == 1, masked_before + tl.cumsum(masked, 0) - 1,
                        total + other_before + tl.cumsum(other, 0) - 1)
        tl.store(out_ptr + row * stride_o + slot, pos, mask=inside & (slot < width))
        masked_before += tl.sum(masked, 0)
        other_before += tl.sum(other, 0)
    tl.store(count_ptr + row, tl.minimum(total, width))


def mask_positions_triton(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [R, N] bool -> (positions [R, min(width, N)] int32, counts [R] int32): the Triton path of
    :func:`mask_positions`."""
    R, N = mask.shape
    width = max(1, min(width, N))
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    mask = mask.view(torch.uint8)  # the same bytes; a byte pointer rather than a 1-bit one for the kernel
    positions = torch.empty(R, width, device=mask.device, dtype=torch.int32)
    counts = torch.empty(R, device=mask.device, dtype=torch.int32)
    _mask_positions_kernel[(R,)](mask, positions, counts, mask.stride(0), positions.stride(0), N, width,
                                 BLOCK=min(SCAN_BLOCK, max(16, triton.next_power_of_2(N))))
    return positions, counts


def mask_positions(mask, width):
    """mask [R, N] bool -> (positions [R, width'] int32, counts [R] int32), width' = min(width, N): each row's masked
    positions ascending, then its other positions ascending, cut at width'; counts = masked positions, at most
    width'. Triton or ``reference.mask_positions_ref`` (identical results)."""
    return implementation("mask_positions", mask.device)(mask, width)
