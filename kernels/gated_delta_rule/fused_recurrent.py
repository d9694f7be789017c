"""Recurrent (token-by-token) gated delta rule: one Triton launch runs all ``T`` steps.

This is the decode path: ``T`` is usually 1, the state ``[B, H, K, V]`` (float32) is carried between
calls and, with ``inplace_state=True``, updated in its own memory so a decode loop or a CUDA graph
allocates nothing but the output. Math (``/work/shared/design/gated_delta_rule.md``), per head::

    S_t = exp(g_t) * S_{t-1}                  # GDN: scalar decay; KDA: Diag(exp(g_t)) S_{t-1}
    u_t = beta_t * (v_t - S_t^T k_t)
    S_t = S_t + k_t u_t^T
    o_t = scale * S_t^T q_t

Inference only: the kernels have no backward, so the outputs carry no autograd graph (they behave as
if computed under ``torch.no_grad()``); train through ``chunk_gated_delta_rule`` / ``chunk_kda``.

GQA: ``q`` may have ``H_q = n * H`` heads; query head ``h`` reads the state of key/value head ``h // n``.
Each Triton program owns one ``(batch, kv head, V block)`` slice of the state in registers, updates it
once per step, and writes the outputs of all ``n`` query heads of its group.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..backend import implementation
from ..device import multiprocessors


@triton.jit
def recurrent_delta_rule_kernel(
    q,  # [B, T, H * GROUP, K]
    k,  # [B, T, H, K]
    v,  # [B, T, H, V]
    g,  # [B, T, H] (scalar decay) or [B, T, H, K] (PER_KEY_DECAY)
    beta,  # [B, T, H]
    o,  # [B, T, H * GROUP, V]
    h0,  # [B, H, K, V] or unused
    ht,  # [B, H, K, V] or unused (may alias h0: each program reads its slice before writing it)
    scale,
    T,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PER_KEY_DECAY: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    HQ = H * GROUP

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_state = mask_k[:, None] & mask_v[None, :]

    kv_row = i_b * T * H + i_h  # (batch, t=0, kv head) row index into [B*T*H]
    q_row = i_b * T * HQ + i_h * GROUP  # first query head of the group at t=0
    p_q = q + q_row * K + offs_k
    p_o = o + q_row * V + offs_v
    p_k = k + kv_row * K + offs_k
    p_v = v + kv_row * V + offs_v
    p_beta = beta + kv_row
    if PER_KEY_DECAY:
        p_g = g + kv_row * K + offs_k
    else:
        p_g = g + kv_row

    state = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V + offs_k[:, None] * V + offs_v[None, :]
        state += tl.load(p_h0, mask=mask_state, other=0.0).to(tl.float32)

    for _ in range(T):
        b_k = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta).to(tl.float32)
        if PER_KEY_DECAY:
            b_g = tl.load(p_g, mask=mask_k, other=0.0).to(tl.float32)
            state = state * tl.exp(b_g)[:, None]
        else:
            state = state * tl.exp(tl.load(p_g).to(tl.float32))
        delta = b_beta * (b_v - tl.sum(state * b_k[:, None], axis=0))
        state = state + b_k[:, None] * delta[None, :]
        for j in tl.static_range(GROUP):
            b_q = tl.load(p_q + j * K, mask=mask_k, other=0.0).to(tl.float32) * scale
            b_o = tl.sum(state * b_q[:, None], axis=0)
            tl.store(p_o + j * V, b_o.to(p_o.dtype.element_ty), mask=mask_v)
        p_q += HQ * K
        p_o += HQ * V
        p_k += H * K
        p_v += H * V
        p_beta += H
        if PER_KEY_DECAY:
            p_g += H * K
        else:
            p_g += H

    if STORE_FINAL_STATE:
        p_ht = ht + i_bh * K * V + offs_k[:, None] * V + offs_v[None, :]
        tl.store(p_ht, state.to(p_ht.dtype.element_ty), mask=mask_state)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Value block of a step: the widest of DECODE_WIDE_BV, DECODE_WIDE_BV / 2, ... that still gives DECODE_PROGRAMS_PER_SM
# programs per SM, else the thin one-warp block; measured: BENCHMARKS.md, History > Linear-attention kernels >
# 2026-11-30 — KDA forward past fla, `_bwd_wy` at 4 warps, decode blocks that widen with the batch
DECODE_WIDE_BV = 64
DECODE_PROGRAMS_PER_SM = 2

# (B, H, K, V, device) -> (grid, BK, BV, num_warps): computed once per decode shape so a step does no arithmetic
_LAUNCH_CONFIG: dict[tuple, tuple[tuple[int, int], int, int, int]] = {}


def _launch_config(B: int, H: int, K: int, V: int, device: torch.device) -> tuple[tuple[int, int], int, int, int]:
    key = (B, H, K, V, device)
    config = _LAUNCH_CONFIG.get(key)
    if config is None:
        BK = triton.next_power_of_2(K)
        # A thin V block keeps the [BK, BV] state slice in one warp's registers (the K reduction stays
        # inside the warp) and gives B=1 decode enough programs to cover the GPU.
        BV = min(triton.next_power_of_2(V), max(8, 1024 // BK))
        sms = multiprocessors(device)
        if sms is not None:
            wide = min(DECODE_WIDE_BV, triton.next_power_of_2(V))
            while wide > BV and triton.cdiv(V, wide) * B * H < DECODE_PROGRAMS_PER_SM * sms:
                wide //= 2
            BV = max(BV, wide)
        if _INTERPRETED:
            # The CPU interpreter pays per program, not per element: use at most two V blocks (still
            # exercising the V-block offsets) so the CPU tests stay fast.
            BV = max(BV, triton.next_power_of_2(V) // 2)
        num_warps = 1 if BK * BV <= 1024 else 4
        config = ((triton.cdiv(V, BV), B * H), BK, BV, num_warps)
        _LAUNCH_CONFIG[key] = config
    return config


def _as_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    inplace_state: bool,
    per_key_decay: bool,
    op_name: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared host function of the GDN (scalar decay) and KDA (per-key decay) recurrent kernels."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"{op_name}: q, k, v must be 4-D [B, T, H, K|V], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, H, K = k.shape
    V = v.shape[-1]
    HQ = q.shape[2]
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"{op_name}: v must be [B, T, H, V] = [{B}, {T}, {H}, V] like k, got {tuple(v.shape)}")
    if q.shape[0] != B or q.shape[1] != T or q.shape[3] != K or HQ % H != 0:
        raise ValueError(
            f"{op_name}: q must be [B, T, n*H, K] = [{B}, {T}, n*{H}, {K}], got {tuple(q.shape)}"
        )
    g_shape = (B, T, H, K) if per_key_decay else (B, T, H)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"{op_name}: g must be {list(g_shape)}, got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"{op_name}: beta must be {[B, T, H]}, got {list(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(f"{op_name}: initial_state must be {[B, H, K, V]}, got {list(initial_state.shape)}")
    if inplace_state:
        if initial_state is None:
            raise ValueError(f"{op_name}: inplace_state=True needs initial_state (the buffer to update)")
        if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError(f"{op_name}: inplace_state=True needs a contiguous float32 initial_state, got {initial_state.dtype}")

    q, k, v, g, beta = _as_contiguous(q), _as_contiguous(k), _as_contiguous(v), _as_contiguous(g), _as_contiguous(beta)
    if initial_state is not None:
        initial_state = _as_contiguous(initial_state)
    if scale is None:
        scale = K ** -0.5

    o = torch.empty(B, T, HQ, V, dtype=v.dtype, device=v.device)
    if inplace_state:
        final_state = initial_state
    elif output_final_state:
        final_state = torch.empty(B, H, K, V, dtype=torch.float32, device=v.device)
    else:
        final_state = None

    grid, BK, BV, num_warps = _launch_config(B, H, K, V, v.device)
    recurrent_delta_rule_kernel[grid](
        q, k, v, g, beta, o, initial_state, final_state, scale, T,
        H=H, GROUP=HQ // H, K=K, V=V, BK=BK, BV=BV,
        PER_KEY_DECAY=per_key_decay,
        USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=final_state is not None,
        num_warps=num_warps,
    )
    return o, final_state


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    inplace_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet, recurrent form, all ``T`` steps in one kernel launch (inference only, no autograd).

    Args:
        q: ``[B, T, H_q, K]`` queries, ``H_q = n * H`` (GQA: query head ``h`` reads kv head ``h // n``).
        k: ``[B, T, H, K]`` keys (L2-normalised by the caller).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H]`` log-space decay (``<= 0``; 0 = keep the state).
        beta: ``[B, T, H]`` write strength in ``(0, 1)`` (0 = no write).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state entering step 1 (any float dtype; zeros when None).
        output_final_state: return the state after step ``T`` as a new float32 ``[B, H, K, V]`` tensor.
        inplace_state: write the final state into ``initial_state`` (contiguous float32) and return it;
            no allocation besides ``o``, as decode loops and CUDA graphs need.

    Returns:
        ``(o, state)``: ``o`` ``[B, T, H_q, V]`` in ``v``'s dtype; ``state`` ``[B, H, K, V]`` float32,
        or None when neither ``output_final_state`` nor ``inplace_state``.

    q, k, v may be bf16 or fp32; the state is accumulated in fp32.
    """
    return implementation("recurrent_delta_rule", q.device)(
        q, k, v, g, beta, scale, initial_state, output_final_state, inplace_state,
        per_key_decay=False, op_name="fused_recurrent_gated_delta_rule",
    )
