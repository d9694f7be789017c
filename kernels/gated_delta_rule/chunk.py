"""Chunked Gated DeltaNet (scalar decay per head and step): Triton forward and backward.

The kernels live in kernels/delta_common/chunk_{fwd,bwd}_kernels.py, launched by delta_common/chunk.py (shared
with KDA); this module is the public entry. Where Triton does not run (``retrofit.kernels.backend``), the same call
runs the PyTorch chunked form (``delta_common/reference.py``).
"""
from __future__ import annotations

from ..backend import implementation

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """Gated delta rule over whole sequences, chunk-parallel (chunks of 64), differentiable in q, k, v, g,
    beta and initial_state.

    q [B, T, Hq, K] (Hq a multiple of H: grouped query heads read the state of kv head hq // (Hq // H)),
    k [B, T, H, K] (L2-normalised by the caller), v [B, T, H, V], g [B, T, H] log-space decay (<= 0),
    beta [B, T, H] in (0, 1), initial_state [B, H, K, V] or None; scale defaults to K ** -0.5.
    Triton: K, V in {16, 32, 64, 128}; dtypes float32, bfloat16 or float16 (fp32 accumulation and state).
    Returns (o [B, T, Hq, V] in v's dtype, final state [B, H, K, V] float32 if output_final_state else None).
    Raises ValueError naming the offending argument.
    """
    return implementation("chunk_delta_rule", q.device)(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                       per_channel=False)
