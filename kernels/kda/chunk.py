"""Chunked Kimi Delta Attention (per-channel decay): Triton forward and backward.

The kernels live in kernels/delta_common/chunk_{fwd,bwd}_kernels.py, launched by delta_common/chunk.py (shared
with GDN); this module is the public entry. Where Triton does not run (``retrofit.kernels.backend``), the same call
runs the PyTorch chunked form (``delta_common/reference.py``).
"""
from __future__ import annotations

from ..backend import implementation

__all__ = ["chunk_kda"]


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """KDA over whole sequences, chunk-parallel (chunks of 64), differentiable in q, k, v, g, beta and
    initial_state.

    As chunk_gated_delta_rule, except g is [B, T, H, K]: a log-space decay (<= 0) per key channel.
    Clamp g from below in the layer (about -5 per step) for numerically meaningful gates.
    Returns (o [B, T, Hq, V] in v's dtype, final state [B, H, K, V] float32 if output_final_state else None).
    """
    return implementation("chunk_delta_rule", q.device)(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       per_channel=True)
