"""Kimi Delta Attention (arXiv 2510.26692) as a drop-in replacement for a Llama/Qwen2/Mistral ``self_attn``.

Gated DeltaNet with a per-key-channel decay from a low-rank projection,
``g = -exp(A_log) * softplus(W_up W_down x + dt_bias)`` (``[B, T, H_kv, head_dim]``, clamped from below), and a
sigmoid low-rank output gate. Everything else (projections, conv, norm, cache, GQA) is the delta-rule forward of
``delta_rule.py``, shared with GDN.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from retrofit.kernels import chunk_kda, fused_recurrent_kda
from retrofit.layers.delta_rule import DeltaRuleAttention
from retrofit.layers.modules import init_decay, logit


class KimiDeltaAttention(DeltaRuleAttention):
    """KDA layer; constructor, forward and cache layout of :class:`DeltaRuleAttention`."""

    layer_kind = "kda"
    chunk_op = staticmethod(chunk_kda)
    recurrent_op = staticmethod(fused_recurrent_kda)
    per_key_decay = True

    def _build_gates(self) -> None:
        hidden, hq, hk, d = self.shape.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        rank = self.spec.gate_rank or d
        self.f_a_proj = nn.Linear(hidden, rank, bias=False)
        self.f_b_proj = nn.Linear(rank, hk * d, bias=False)
        self.A_log = nn.Parameter(torch.zeros(hk))
        self.dt_bias = nn.Parameter(torch.zeros(hk * d))
        self.g_a_proj = nn.Linear(hidden, rank, bias=False)
        self.g_b_proj = nn.Linear(rank, hq * d, bias=True)

    def reset_gates(self) -> None:
        """Low-rank gates start as constants (up-projection zero, down-projection small random): slow per-channel
        decay and an output gate near 1; gradients reach the up-projections first."""
        with torch.no_grad():
            self.b_proj.weight.zero_()
            self.b_proj.bias.fill_(logit(self.spec.beta_init))
            gen = torch.Generator().manual_seed(1000 + self.layer_idx)
            std = self.shape.hidden_size ** -0.5
            self.f_a_proj.weight.copy_(torch.randn(self.f_a_proj.weight.shape, generator=gen) * std)
            self.g_a_proj.weight.copy_(torch.randn(self.g_a_proj.weight.shape, generator=gen) * std)
            self.f_b_proj.weight.zero_()
            self.g_b_proj.weight.zero_()
            self.g_b_proj.bias.fill_(logit(self.spec.gate_init))
            init_decay(self.A_log, self.dt_bias, self.spec, repeat=self.num_kv_heads // self.shape.num_kv_heads)

    @property
    def decay_lower_bound(self) -> float:
        return self.spec.gate_lower_bound

    def gate_input_projections(self) -> list[nn.Linear]:
        return [self.f_a_proj, self.g_a_proj]

    def decay_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> ``W_up W_down x`` ``[B, T, H_kv * head_dim]``: per channel
        g = -exp(A_log) * softplus(W_up W_down x + dt_bias), clamped from below."""
        return self.f_b_proj(self.f_a_proj(x))

    def output_gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[B, T, hidden]`` -> the low-rank ``[B, T, H_q * head_dim]`` (the gate is its sigmoid)."""
        return self.g_b_proj(self.g_a_proj(x))
