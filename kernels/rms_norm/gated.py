"""The delta-rule layers' output norm in Triton: ``weight * o / rms(o) * sigmoid(gate_logits)`` per head, one
program per (token, head) row, one launch where the PyTorch form is about ten element-wise kernels (the sigmoid, the
casts, the mean square, the scale, the two products). Semantics: ``reference.sigmoid_gated_rms_norm_ref`` beside
this file. Inference only (no backward); no host synchronisation, so a CUDA graph can hold it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation


@triton.jit
def _sigmoid_gated_rms_norm_kernel(o_ptr, gate_ptr, weight_ptr, out_ptr, heads, D, gate_token_stride, eps,
                                   BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = row % heads
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    o = tl.load(o_ptr + row * D + cols, mask=inside, other=0.0).to(tl.float32)
    logits = tl.load(gate_ptr + (row // heads) * gate_token_stride + head * D + cols, mask=inside, other=0.0)
    # the sigmoid rounded to the logits' dtype, as torch.sigmoid of a bf16 projection gives it
    gate = tl.sigmoid(logits.to(tl.float32)).to(gate_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + head * D + cols, mask=inside, other=0.0).to(tl.float32)
    normed = o * tl.math.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    tl.store(out_ptr + row * D + cols, (normed * weight * gate).to(out_ptr.dtype.element_ty), mask=inside)


def sigmoid_gated_rms_norm_triton(o: torch.Tensor, gate_logits: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> torch.Tensor:
    """The Triton path of :func:`sigmoid_gated_rms_norm` (same arguments, same result up to fp32 rounding)."""
    H, D = weight.shape
    if o.shape != gate_logits.shape or o.shape[-2:] != (H, D):
        raise ValueError(f"o {tuple(o.shape)} and gate_logits {tuple(gate_logits.shape)} must both be [..., {H}, "
                         f"{D}] (the weight's heads and head dim)")
    o, weight = o.contiguous(), weight.contiguous()
    # the logits as [tokens, H * D]: a view for a column block of a wider buffer (a merged projection's output), whose
    # tokens lie further apart than H * D
    gate_tokens = gate_logits.reshape(-1, H * D)
    if gate_tokens.stride(1) != 1:
        gate_tokens = gate_tokens.contiguous()
    out = torch.empty_like(o)
    rows = o.numel() // D
    if rows:
        _sigmoid_gated_rms_norm_kernel[(rows,)](o, gate_tokens, weight, out, H, D, gate_tokens.stride(0), eps,
                                                BLOCK_D=triton.next_power_of_2(D))
    return out


def sigmoid_gated_rms_norm(o, gate_logits, weight, eps):
    """o [..., H, D], gate_logits [..., H, D] (the output gate before its sigmoid; each token's H * D logits contiguous,
    tokens possibly further apart), weight [H, D] -> [..., H, D] in
    o's dtype: ``weight * o / rms(o) * sigmoid(gate_logits)`` over each head's D channels (fp32 statistics). Triton or
    ``reference.sigmoid_gated_rms_norm_ref``."""
    return implementation("sigmoid_gated_rms_norm", o.device)(o, gate_logits, weight, eps)
