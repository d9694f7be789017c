"""Triton antidiagonal block mass: XAttention's estimate of where each query block's attention falls, fused.

The strided logits ``runs_q . runs_k`` (one per query run and key run: a tile's antidiagonal, see
``reference.antidiagonal_block_mass_ref``) are never written to memory. Two passes over the causal key runs of a
tile of query runs, flash-attention style (fp32 accumulation, exp2 domain):

1. ``_run_stats_kernel``: each query run's row maximum and softmax denominator over its visible key runs;
2. ``_block_mass_kernel``: the logits again, their softmax weights from those statistics, summed over the runs of
   every (query block, key block) pair and written as one fp32 value per pair.

What the unfused estimate spent its time on at long prompts (writing, softmaxing and reducing a ``[runs, runs]``
fp32 matrix per head) becomes one read of the keys' runs per tile of queries. Semantics: the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

_LOG2E = 1.4426950408889634
# Launch defaults from an H100 (2026-12-07, benchmarks/sparse_prefill_parts.py --tune-estimate, Llama-3-8B's heads,
# stride 8): tiles of 128 query and key runs (more when a block holds more runs), 64 features a product step, 8 warps:
# 3.27 ms at 32K and 58.4 ms at 127K against 6.24 and 116.6 with 64-run tiles at 4 warps.
_MIN_TILE = 128
_BLOCK_E = 64
_NUM_WARPS = 8


@triton.jit
def _strided_logits(qr_base, kr_base, r, c, r_ok, c_ok, stride_qr, stride_kr, E,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_R, BLOCK_C] fp32 products of the query runs ``r`` with the key runs ``c`` over their E features."""
    s = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_ok = e < E
        q = tl.load(qr_base + r.to(tl.int64)[:, None] * stride_qr + e[None, :], mask=r_ok[:, None] & e_ok[None, :],
                    other=0.0)
        k = tl.load(kr_base + c.to(tl.int64)[:, None] * stride_kr + e[None, :], mask=c_ok[:, None] & e_ok[None, :],
                    other=0.0)
        if IEEE:
            s += tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s += tl.dot(q, tl.trans(k))
    return s


@triton.jit
def _tile(qr_ptr, kr_ptr, start_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_start, Hq, Rq, Rk,
          first_run, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    """A program's tile: its query runs ``r`` (local), their batch row's first valid key, the row's and head's runs
    of queries and of keys, and how many key runs the tile may see (none after its last query run: causal)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    kv_start = tl.load(start_ptr + b * stride_start)
    qr_base = qr_ptr + b * stride_qb + h * stride_qh
    kr_base = kr_ptr + b * stride_kb + (h // GROUP) * stride_kh
    key_runs = tl.minimum(first_run + tl.minimum(tile * BLOCK_R + BLOCK_R, Rq), Rk)
    return r, kv_start, qr_base, kr_base, key_runs


@triton.jit
def _masked_logits(qr_base, kr_base, r, c, stride_qr, stride_kr, Rq, Rk, E, first_run, q_lo, q_hi, kv_start, S,
                   logit_scale, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
                   IEEE: tl.constexpr):
    """[BLOCK_R, BLOCK_C] logits (exp2 domain) of query runs ``r`` over key runs ``c``; -inf where key run ``c`` is
    not visible to query run ``r`` (after it, in the row's padding, or the query run outside the chunk)."""
    s = _strided_logits(qr_base, kr_base, r, c, r < Rq, c < Rk, stride_qr, stride_kr, E, BLOCK_R, BLOCK_C, BLOCK_E,
                        IEEE)
    r_abs = first_run + r
    live = (r < Rq) & ((r_abs + 1) * S > q_lo) & (r_abs * S < q_hi) & ((r_abs + 1) * S > kv_start)
    visible = live[:, None] & (c[None, :] <= r_abs[:, None]) & (c < Rk)[None, :] & ((c + 1) * S > kv_start)[None, :]
    return tl.where(visible, s * logit_scale, float("-inf"))


@triton.jit
def _run_stats_kernel(
    qr_ptr, kr_ptr, start_ptr, max_ptr, sum_ptr,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_kr, stride_start,
    Hq, Rq, Rk, E, first_run, q_lo, q_hi, S, logit_scale,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
):
    r, kv_start, qr_base, kr_base, key_runs = _tile(qr_ptr, kr_ptr, start_ptr, stride_qb, stride_qh, stride_kb,
                                                    stride_kh, stride_start, Hq, Rq, Rk, first_run, GROUP, BLOCK_R)
    r_ok = r < Rq
    bh = tl.program_id(1)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, key_runs, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        s = _masked_logits(qr_base, kr_base, r, c, stride_qr, stride_kr, Rq, Rk, E, first_run, q_lo, q_hi, kv_start,
                           S, logit_scale, BLOCK_R, BLOCK_C, BLOCK_E, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    out = bh.to(tl.int64) * Rq + r
    tl.store(max_ptr + out, m_i, mask=r_ok)
    tl.store(sum_ptr + out, l_i, mask=r_ok)


@triton.jit
def _block_mass_kernel(
    qr_ptr, kr_ptr, start_ptr, max_ptr, sum_ptr, mass_ptr,
    stride_qb, stride_qh, stride_qr, stride_kb, stride_kh, stride_kr, stride_start,
    Hq, Rq, Rk, E, first_run, q_lo, q_hi, S, logit_scale,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
    PER_BLOCK: tl.constexpr,
):
    r, kv_start, qr_base, kr_base, key_runs = _tile(qr_ptr, kr_ptr, start_ptr, stride_qb, stride_qh, stride_kb,
                                                    stride_kh, stride_start, Hq, Rq, Rk, first_run, GROUP, BLOCK_R)
    r_ok = r < Rq
    bh = tl.program_id(1)
    stats = bh.to(tl.int64) * Rq + r
    m_i = tl.load(max_ptr + stats, mask=r_ok, other=float("-inf"))
    l_i = tl.load(sum_ptr + stats, mask=r_ok, other=0.0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inverse = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
    ROW_BLOCKS: tl.constexpr = BLOCK_R // PER_BLOCK
    COL_BLOCKS: tl.constexpr = BLOCK_C // PER_BLOCK
    rows = tl.program_id(0) * ROW_BLOCKS + tl.arange(0, ROW_BLOCKS)
    row_blocks = Rq // PER_BLOCK
    key_blocks = Rk // PER_BLOCK
    mass_base = mass_ptr + bh.to(tl.int64) * row_blocks * key_blocks
    for c0 in range(0, key_runs, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        s = _masked_logits(qr_base, kr_base, r, c, stride_qr, stride_kr, Rq, Rk, E, first_run, q_lo, q_hi, kv_start,
                           S, logit_scale, BLOCK_R, BLOCK_C, BLOCK_E, IEEE)
        p = tl.exp2(s - m_safe[:, None]) * inverse[:, None]
        blocks = tl.sum(tl.sum(tl.reshape(p, (ROW_BLOCKS, PER_BLOCK, COL_BLOCKS, PER_BLOCK)), 3), 1)
        cols = c0 // PER_BLOCK + tl.arange(0, COL_BLOCKS)
        tl.store(mass_base + rows.to(tl.int64)[:, None] * key_blocks + cols[None, :], blocks,
                 mask=(rows < row_blocks)[:, None] & (cols < key_blocks)[None, :])


def antidiagonal_block_mass_triton(
    runs_q: torch.Tensor,
    runs_k: torch.Tensor,
    kv_start: torch.Tensor,
    runs_per_block: int,
    stride: int,
    first_run: int,
    q_offset: int,
    T: int,
    logit_scale: float,
    tile: int | None = None,
    block_e: int = _BLOCK_E,
    num_warps: int = _NUM_WARPS,
) -> torch.Tensor:
    """The Triton path of :func:`antidiagonal_block_mass` (same arguments; runs_q and runs_k need a contiguous last
    dimension): two fused passes, the strided logits never written to memory. ``tile`` (query and key runs a program
    holds; default the larger of 128 and ``runs_per_block``), ``block_e`` (features per product step) and
    ``num_warps`` tune the launch only."""
    B, Hq, Rq, E = runs_q.shape
    Hkv, Rk = runs_k.shape[1], runs_k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if Rq % runs_per_block or Rk % runs_per_block or runs_per_block & (runs_per_block - 1):
        raise ValueError(f"runs_per_block ({runs_per_block}) must be a power of two dividing the query runs ({Rq}) "
                         f"and key runs ({Rk})")
    if runs_q.stride(-1) != 1 or runs_k.stride(-1) != 1:
        raise ValueError("runs_q and runs_k need a contiguous last dimension")
    mass = torch.zeros(B, Hq, Rq // runs_per_block, Rk // runs_per_block, device=runs_q.device, dtype=torch.float32)
    if Rq == 0 or Rk == 0:
        return mass
    row_max = torch.empty(B, Hq, Rq, device=runs_q.device, dtype=torch.float32)
    row_sum = torch.empty_like(row_max)
    kv_start = kv_start.to(device=runs_q.device, dtype=torch.int32)
    tile = max(_MIN_TILE, runs_per_block) if tile is None else tile
    if tile % runs_per_block or tile & (tile - 1) or tile < 16:
        raise ValueError(f"tile ({tile}) must be a power of two of at least 16 holding whole blocks of "
                         f"{runs_per_block} runs")
    shared = (runs_q, runs_k, kv_start)
    strides = (runs_q.stride(0), runs_q.stride(1), runs_q.stride(2), runs_k.stride(0), runs_k.stride(1),
               runs_k.stride(2), kv_start.stride(0))
    sizes = (Hq, Rq, Rk, E, first_run, q_offset, q_offset + T, stride, logit_scale * _LOG2E)
    meta = dict(GROUP=Hq // Hkv, BLOCK_R=tile, BLOCK_C=tile, BLOCK_E=block_e, IEEE=runs_q.dtype == torch.float32,
                num_warps=num_warps)
    grid = (triton.cdiv(Rq, tile), B * Hq)
    _run_stats_kernel[grid](*shared, row_max, row_sum, *strides, *sizes, **meta)
    _block_mass_kernel[grid](*shared, row_max, row_sum, mass, *strides, *sizes, **meta, PER_BLOCK=runs_per_block)
    return mass


def antidiagonal_block_mass(runs_q, runs_k, kv_start, runs_per_block, stride, first_run, q_offset, T, logit_scale):
    """XAttention's block mass before its normalisation per query block: runs_q [B, Hq, Rq, E], runs_k [B, Hkv, Rk,
    E], kv_start [B] -> [B, Hq, Rq / runs_per_block, Rk / runs_per_block] fp32 (arguments and semantics:
    ``reference.antidiagonal_block_mass_ref``). Triton (:func:`antidiagonal_block_mass_triton`) or the reference, as
    ``retrofit.kernels.backend`` picks for the runs' device."""
    run = implementation("antidiagonal_block_mass", runs_q.device)
    return run(runs_q, runs_k, kv_start, runs_per_block, stride, first_run, q_offset, T, logit_scale)
