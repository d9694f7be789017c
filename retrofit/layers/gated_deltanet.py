"""Gated DeltaNet attention (arXiv 2412.06464) as a drop-in replacement for a Llama/Qwen2/Mistral ``self_attn``.

Per token: q, k, v projections -> short causal conv (SiLU) -> L2-normalised q, k -> gated delta rule with
``beta = sigmoid(W_b x)`` and ``g = -exp(A_log) * softplus(W_a x + dt_bias)`` -> per-head RMSNorm gated by
``sigmoid(W_g x)`` -> W_o. GQA keeps one state per key-value head; the query heads of a group read it.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from retrofit.layers.common import (
    AttentionShape,
    GatedRMSNorm,
    LinearAttentionSpec,
    ShortConvolution,
    cache_states,
    delta_rule_op,
    init_decay,
    l2_normalize,
    padding_mask,
    rotate,
    store_states,
)


def logit(p: float) -> float:
    return math.log(p / (1 - p))


class GatedDeltaNetAttention(nn.Module):
    """Gated DeltaNet layer with the forward signature of transformers' ``LlamaAttention``.

    Shapes: ``hidden_states [B, T, hidden]`` -> ``(attn_output [B, T, hidden], None)``. The recurrent state is
    ``[B, H_kv, head_dim, head_dim]`` (fp32) and the conv state ``[B, (H_q + 2 H_kv) head_dim, conv_size - 1]``;
    both live in the transformers ``Cache`` passed as ``cache`` / ``past_key_values``.
    """

    layer_kind = retrofit_layer_type = "gdn"

    def __init__(self, shape: AttentionShape, layer_idx: int, spec: LinearAttentionSpec | None = None):
        super().__init__()
        spec = spec or LinearAttentionSpec()
        self.shape, self.layer_idx, self.spec = shape, layer_idx, spec
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_heads if spec.expand_kv else shape.num_kv_heads
        self.head_dim = d = shape.head_dim
        hidden, hq, hk = shape.hidden_size, self.num_heads, self.num_kv_heads
        self.q_proj = nn.Linear(hidden, hq * d, bias=shape.bias)
        self.k_proj = nn.Linear(hidden, hk * d, bias=shape.bias)
        self.v_proj = nn.Linear(hidden, hk * d, bias=shape.bias)
        self.o_proj = nn.Linear(hq * d, hidden, bias=shape.bias)
        self.conv = ShortConvolution((hq + 2 * hk) * d, spec.conv_size)
        self.b_proj = nn.Linear(hidden, hk, bias=True)
        self.o_norm = GatedRMSNorm(hq, d)
        self._build_gates()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initial values of everything not copied from the dense attention (also after ``to_empty``)."""
        self.conv.reset_parameters()
        with torch.no_grad():
            self.o_norm.weight.fill_(1.0)
        self.reset_gates()

    # ----- the parts KDA changes -----
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

    # ----- forward -----
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs) -> tuple[torch.Tensor, None]:
        """hidden_states ``[B, T, hidden]`` -> ``(output [B, T, hidden], None)``; updates the cache if one is given.

        ``attention_mask`` (2-D or 4-D, as transformers passes it) only marks padding: a padded position is made an
        identity step of the recurrence (k = v = 0, beta = 0, g = 0) and outputs zeros.
        """
        cache = cache if cache is not None else past_key_values
        x = hidden_states
        B, T, _ = x.shape
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        keep = padding_mask(attention_mask, B, T, x.device)
        conv_state, recurrent_state = cache_states(cache, self.layer_idx)
        decode = not self.training and T == 1

        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if keep is not None:
            qkv = qkv * keep[..., None].to(qkv.dtype)
        qkv, conv_state = self.conv(qkv, conv_state, decode=decode)
        if keep is not None:
            qkv = qkv * keep[..., None].to(qkv.dtype)
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(B, T, hq, d), k.view(B, T, hk, d), v.reshape(B, T, hk, d).contiguous()
        if self.spec.use_rope and position_embeddings is not None:
            q, k = rotate(q, k, position_embeddings)
        q, k = l2_normalize(q), l2_normalize(k)
        beta = torch.sigmoid(self.b_proj(x).float())
        g = self.decay(x)
        if keep is not None:
            beta = beta * keep[..., None]
            g = g * (keep[..., None, None] if g.dim() == 4 else keep[..., None])
        run = delta_rule_op(g.dim() == 4, decode, x.device)
        o, recurrent_state = run(q, k, v, g, beta, initial_state=recurrent_state, output_final_state=cache is not None)
        if cache is not None:
            store_states(cache, self.layer_idx, conv_state, recurrent_state)
        o = self.o_norm(o, self.output_gate(x))
        return self.o_proj(o.reshape(B, T, hq * d)), None

    def extra_repr(self) -> str:
        return (f"kind={self.layer_kind}, layer_idx={self.layer_idx}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}")
