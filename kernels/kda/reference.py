"""Pure-PyTorch references of Kimi Delta Attention (KDA: the gated delta rule with per-channel decay).

g is [B, T, H, K] (log decay <= 0 per key channel); everything else as in the GDN references.
"""
from __future__ import annotations

from ..delta_common.reference import naive_chunk, naive_recurrent

__all__ = ["naive_recurrent_kda", "naive_chunk_kda"]


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token recurrence in float32 (float64 if any input is float64).

    q [B, T, Hq, K], k [B, T, H, K], v [B, T, H, V], g [B, T, H, K], beta [B, T, H],
    initial_state [B, H, K, V]. Returns (o [B, T, Hq, V] in v's dtype, final state [B, H, K, V] or None).
    """
    return naive_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, per_channel=True)


def naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64):
    """The chunked specification (float64 internally, batched over B and heads)."""
    return naive_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, per_channel=True,
                       chunk_size=chunk_size)
