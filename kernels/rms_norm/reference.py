"""Pure-PyTorch RMSNorm, optionally after a residual add: the specification the Triton kernel is tested against.

The math of transformers' ``LlamaRMSNorm`` (also Mistral's and Qwen2's): the input cast to float32, its mean square
over the last dimension, ``x * rsqrt(mean_square + eps)`` cast back to the input's dtype, times the weight (the
product in the promoted dtype of weight and input). With a residual, the sum ``x + residual`` is formed (and rounded)
in the input's dtype first, as the decoder layer's ``residual + hidden_states`` does, and normalised.
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in the promoted dtype of weight and x."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(input_dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] (one shape and dtype), weight [H] -> (normed [..., H], summed [..., H]) where
    ``summed = residual + x`` (x's dtype) and ``normed = rms_norm_ref(summed, weight, eps)``."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def gated_rms_norm_ref(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The delta-rule layers' output norm: o [..., H, D], gate [..., H, D] (already activated), weight [H, D] ->
    ``weight * o / rms(o) * gate`` over each head's D channels, in fp32, cast to o's dtype."""
    dtype = o.dtype
    o32 = o.float()
    o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    return (o32 * weight.float() * gate.float()).to(dtype)


def sigmoid_gated_rms_norm_ref(o: torch.Tensor, gate_logits: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm_ref` with the gate ``sigmoid(gate_logits)`` (taken in gate_logits' dtype, as the
    layers' ``torch.sigmoid`` of a projection does): o, gate_logits [..., H, D], weight [H, D] -> [..., H, D]."""
    return gated_rms_norm_ref(o, torch.sigmoid(gate_logits), weight, eps)
