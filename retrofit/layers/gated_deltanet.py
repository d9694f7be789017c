"""Gated DeltaNet attention (arXiv 2412.06464) as a drop-in replacement for a Llama/Qwen2/Mistral ``self_attn``.

The delta-rule forward (``delta_rule.py``) with a scalar decay per kv head and token,
``g = -exp(A_log) * softplus(W_a x + dt_bias)``, and an output gate ``sigmoid(W_g x)``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

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

    def gate_input_projections(self) -> list[nn.Linear]:
        return [self.a_proj, self.g_proj]

    def decay_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> ``W_a x`` ``[B, T, H_kv]``: g = -exp(A_log) * softplus(W_a x + dt_bias)."""
        return self.a_proj(x)

    def output_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> ``W_g x`` ``[B, T, H_q * head_dim]`` (the gate is its sigmoid)."""
        return self.g_proj(x)
