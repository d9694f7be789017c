"""One decode token of a GDN or KDA layer after its short conv, in one Triton launch: the L2 norms of q and k, the
write strength ``beta = sigmoid(beta_logits)``, the log decay ``g = -exp(A_log) * softplus(decay_logits + dt_bias)``
(KDA: per key channel, clamped from below) and the recurrence step that updates the state in place. Written as
tensor operations around :func:`fused_recurrent_delta_rule` these were about twenty small kernels per layer and token
(the norms' casts, squares, sums and scales, the gates' element-wise chain, the copies that make q, k, v
contiguous). Each program reads its q, k and v straight from the conv's output row.

Semantics: ``delta_common.reference.delta_rule_decode_step_ref``; q and k are rounded to the input's dtype after
their norm, as the PyTorch path rounds them. Inference only; no host synchronisation, so a CUDA graph can hold it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation
from .fused_recurrent import _launch_config


@triton.jit
def _l2_normalized(x):
    """x fp32 -> x / ||x|| in fp32 (eps: that of ``l2_normalize_ref``)."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _decode_step_kernel(
    qkv, decay_logits, beta_logits, A_log, dt_bias, state, o,
    stride_qkv, stride_decay, stride_beta, scale, lower_bound,
    H: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_KEY_DECAY: tl.constexpr, CLAMP: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    HQ = H * GROUP
    dtype = qkv.dtype.element_ty

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < K
    mask_state = mask_k[:, None] & mask_v[None, :]
    row = qkv + i_b * stride_qkv

    # q and k rounded to the input's dtype after their norms, as the PyTorch path stores them
    b_k = _l2_normalized(tl.load(row + (HQ + i_h) * K + offs_k, mask=mask_k, other=0.0).to(tl.float32))
    b_k = b_k.to(dtype).to(tl.float32)
    b_v = tl.load(row + (HQ + H + i_h) * K + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(beta_logits + i_b * stride_beta + i_h).to(tl.float32))
    rate = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    if PER_KEY_DECAY:
        a = tl.load(decay_logits + i_b * stride_decay + i_h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a += tl.load(dt_bias + i_h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    else:
        a = tl.load(decay_logits + i_b * stride_decay + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    b_g = -rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, linear past torch's threshold 20
    if CLAMP:
        b_g = tl.maximum(b_g, lower_bound)

    p_state = state + i_bh * K * K + offs_k[:, None] * K + offs_v[None, :]
    b_state = tl.load(p_state, mask=mask_state, other=0.0)
    if PER_KEY_DECAY:
        b_state = b_state * tl.exp(b_g)[:, None]
    else:
        b_state = b_state * tl.exp(b_g)
    delta = b_beta * (b_v - tl.sum(b_state * b_k[:, None], axis=0))
    b_state = b_state + b_k[:, None] * delta[None, :]
    for j in tl.static_range(GROUP):
        head = i_h * GROUP + j
        b_q = _l2_normalized(tl.load(row + head * K + offs_k, mask=mask_k, other=0.0).to(tl.float32))
        b_q = b_q.to(dtype).to(tl.float32)
        b_o = tl.sum(b_state * (b_q * scale)[:, None], axis=0)
        tl.store(o + (i_b * HQ + head) * K + offs_v, b_o.to(dtype), mask=mask_v)
    tl.store(p_state, b_state, mask=mask_state)


def delta_rule_decode_step_triton(qkv: torch.Tensor, decay_logits: torch.Tensor, beta_logits: torch.Tensor,
                                  A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, num_heads: int,
                                  per_key_decay: bool, lower_bound: float | None = None,
                                  scale: float | None = None) -> torch.Tensor:
    """The Triton path of :func:`delta_rule_decode_step` (same arguments, same result up to fp32 rounding)."""
    B, H, K, V = state.shape
    if K != V or qkv.shape != (B, (num_heads + 2 * H) * K) or num_heads % H:
        raise ValueError(f"qkv {tuple(qkv.shape)} must be [B, (Hq + 2 H) D] for the state {tuple(state.shape)} "
                         f"[B, H, D, D] and {num_heads} query heads (a multiple of H)")
    if decay_logits.shape != (B, H * K if per_key_decay else H) or beta_logits.shape != (B, H):
        raise ValueError(f"decay_logits {tuple(decay_logits.shape)} / beta_logits {tuple(beta_logits.shape)} do "
                         f"not fit {B} rows of {H} kv heads (per key: {per_key_decay})")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the state must be a contiguous float32 tensor (it is updated in place)")
    for name, x in (("qkv", qkv), ("decay_logits", decay_logits), ("beta_logits", beta_logits)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    o = torch.empty(B, num_heads, K, dtype=qkv.dtype, device=qkv.device)
    grid, BK, BV, num_warps = _launch_config(B, H, K, V, qkv.device)
    _decode_step_kernel[grid](
        qkv, decay_logits, beta_logits, A_log, dt_bias, state, o,
        qkv.stride(0), decay_logits.stride(0), beta_logits.stride(0), K ** -0.5 if scale is None else scale,
        0.0 if lower_bound is None else lower_bound,
        H=H, GROUP=num_heads // H, K=K, BK=BK, BV=BV, PER_KEY_DECAY=per_key_decay, CLAMP=lower_bound is not None,
        num_warps=num_warps,
    )
    return o


def delta_rule_decode_step(qkv, decay_logits, beta_logits, A_log, dt_bias, state, num_heads, per_key_decay,
                           lower_bound=None, scale=None):
    """One decode token of a GDN (``per_key_decay=False``) or KDA layer after its short conv.

    qkv [B, (Hq + 2 H) D] (queries, keys, values of the token), decay_logits [B, H] or [B, H * D], beta_logits
    [B, H], A_log [H], dt_bias [H] or [H * D], state [B, H, D, D] float32 (updated in place), num_heads = Hq ->
    o [B, Hq, D] in qkv's dtype, ``scale`` default ``D ** -0.5``. Triton or
    ``delta_common.reference.delta_rule_decode_step_ref``.
    """
    return implementation("delta_rule_decode_step", qkv.device)(qkv, decay_logits, beta_logits, A_log, dt_bias,
                                                                state, num_heads, per_key_decay, lower_bound, scale)
