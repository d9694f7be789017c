"""Gated DeltaNet attention (arXiv 2412.06464) as a drop-in replacement for a Llama/Qwen2/Mistral ``self_attn``.

The delta-rule forward (``delta_rule.py``) with a scalar decay per kv head and token,
``g = -exp(A_log) * softplus(W_a x + dt_bias)``, and an output gate ``sigmoid(W_g x)``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from retrofit.kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from retrofit.layers.delta_rule import DeltaRuleAttention
from retrofit.layers.modules import init_decay, logit


class GatedDeltaNetAttention(DeltaRuleAttention):
    """Gated DeltaNet layer; constructor, forward and cache layout of :class:`DeltaRuleAttention`."""

    layer_kind = "gdn"
    chunk_op = staticmethod(chunk_gated_delta_rule)
    recurrent_op = staticmethod(fused_recurrent_gated_delta_rule)

    def _build_gates(self) -> None:
        hidden, hq, hk, d = self.shape.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.a_proj = nn.Linear(hidden, hk, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hk))
        self.dt_bias = nn.Parameter(torch.zeros(hk))
        self.g_proj = nn.Linear(hidden, hq * d, bias=True)

    def reset_gates(self) -> None:
        """New parameters start so that the layer is "conv = identity, beta, slow decay, output gate near 1"."""
        with torch.no_grad():
            self.b_proj.weight.zero_()
            self.b_proj.bias.fill_(logit(self.spec.beta_init))
            self.a_proj.weight.zero_()
            init_decay(self.A_log, self.dt_bias, self.spec, repeat=self.num_kv_heads // self.shape.num_kv_heads)
            self.g_proj.weight.zero_()
            self.g_proj.bias.fill_(logit(self.spec.gate_init))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> log decay g ``[B, T, H_kv]`` (fp32, <= 0)."""
        a = self.a_proj(x).float() + self.dt_bias.float()
        return -self.A_log.float().exp() * F.softplus(a)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> gate ``[B, T, H_q, head_dim]`` in (0, 1)."""
        B, T, _ = x.shape
        return torch.sigmoid(self.g_proj(x)).view(B, T, self.num_heads, self.head_dim)
