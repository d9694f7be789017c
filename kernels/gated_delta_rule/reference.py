"""Pure-PyTorch references of the gated delta rule (GDN, scalar decay per head and step).

See kernels/delta_common/reference.py for shapes and math. Both functions are differentiable
through torch.autograd (use float64 inputs for gradient references).
"""
from __future__ import annotations

from ..delta_common.reference import naive_chunk, naive_recurrent

__all__ = ["naive_recurrent_gated_delta_rule", "naive_chunk_gated_delta_rule"]


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token recurrence in float32 (float64 if any input is float64).

    q [B, T, Hq, K], k [B, T, H, K], v [B, T, H, V], g [B, T, H] (log decay <= 0), beta [B, T, H],
    initial_state [B, H, K, V]. Returns (o [B, T, Hq, V] in v's dtype, final state [B, H, K, V] or None).
    """
    return naive_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, per_channel=False)


def naive_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                 chunk_size=64):
    """The chunked specification (float64 internally, batched over B and heads)."""
    return naive_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, per_channel=False,
                       chunk_size=chunk_size)
