"""Triton kernels that turn a token mask into a fixed-width list of positions (stream compaction): the selection
ClusterKV and RetrievalAttention hand to the sparse attention. A two-level prefix sum, parallel over rows and blocks of
the mask: one kernel counts each block's masked positions, the next places every position from the counts of the
blocks before its own. The stable sort it replaces ran over every position of the buffer, per layer and decode step;
a scan with one program per row ran 250 us a layer at 127K tokens on the H200 (BENCHMARKS.md, End-to-end
generation). Semantics: ``reference.mask_positions_ref`` (identical output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

SCAN_BLOCK = 1024


@triton.jit
def _mask_block_counts_kernel(mask_ptr, block_counts_ptr, stride_m, stride_c, N, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    pos = block * BLOCK + tl.arange(0, BLOCK)
    masked = tl.load(mask_ptr + row * stride_m + pos, mask=pos < N, other=0).to(tl.int32)
    tl.store(block_counts_ptr + row * stride_c + block, tl.sum(masked, 0))


@triton.jit
def _mask_positions_kernel(mask_ptr, block_counts_ptr, out_ptr, count_ptr, stride_m, stride_c, stride_o, N, width,
                           num_blocks, BLOCK: tl.constexpr, BLOCKS_POW2: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    blocks = tl.arange(0, BLOCKS_POW2)
    counts = tl.load(block_counts_ptr + row * stride_c + blocks, mask=blocks < num_blocks, other=0)
    total = tl.sum(counts, 0)
    masked_before = tl.sum(tl.where(blocks < block, counts, 0), 0)
    other_before = block * BLOCK - masked_before  # every block before the last is whole
    pos = block * BLOCK + tl.arange(0, BLOCK)
    inside = pos < N
    masked = tl.load(mask_ptr + row * stride_m + pos, mask=inside, other=0).to(tl.int32)
    other = inside.to(tl.int32) - masked
    slot = tl.where(masked == 1, masked_before + tl.cumsum(masked, 0) - 1,
                    total + other_before + tl.cumsum(other, 0) - 1)
    tl.store(out_ptr + row * stride_o + slot, pos, mask=inside & (slot < width))
    if block == 0:
        tl.store(count_ptr + row, tl.minimum(total, width))


def mask_positions_triton(mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [R, N] bool -> (positions [R, min(width, N)] int32, counts [R] int32): the Triton path of
    :func:`mask_positions`."""
    R, N = mask.shape
    width = max(1, min(width, N))
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    mask = mask.view(torch.uint8)  # the same bytes; a byte pointer rather than a 1-bit one for the kernel
    block = min(SCAN_BLOCK, max(16, triton.next_power_of_2(N)))
    num_blocks = triton.cdiv(N, block)
    block_counts = torch.empty(R, num_blocks, device=mask.device, dtype=torch.int32)
    positions = torch.empty(R, width, device=mask.device, dtype=torch.int32)
    counts = torch.empty(R, device=mask.device, dtype=torch.int32)
    _mask_block_counts_kernel[(R, num_blocks)](mask, block_counts, mask.stride(0), block_counts.stride(0), N,
                                               BLOCK=block)
    _mask_positions_kernel[(R, num_blocks)](mask, block_counts, positions, counts, mask.stride(0),
                                            block_counts.stride(0), positions.stride(0), N, width, num_blocks,
                                            BLOCK=block, BLOCKS_POW2=max(2, triton.next_power_of_2(num_blocks)))
    return positions, counts


def mask_positions(mask, width):
    """mask [R, N] bool -> (positions [R, width'] int32, counts [R] int32), width' = min(width, N): each row's masked
    positions ascending, then its other positions ascending, cut at width'; counts = masked positions, at most
    width'. Triton or ``reference.mask_positions_ref`` (identical results)."""
    return implementation("mask_positions", mask.device)(mask, width)
