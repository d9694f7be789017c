"""Recurrent (token-by-token) Kimi Delta Attention: one Triton launch runs all ``T`` steps.

KDA is the gated delta rule with a per-key-channel decay, ``S_t = Diag(exp(g_t)) S_{t-1}`` with
``g_t in R^K`` (``/work/shared/design/gated_delta_rule.md``). It runs on the same Triton kernel as
GDN's recurrent form (``gated_delta_rule/fused_recurrent.py``) with the per-key decay
switched on at compile time. Inference only (no autograd graph on the outputs).
"""

from __future__ import annotations

import torch

from ..backend import implementation


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    inplace_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA, recurrent form, all ``T`` steps in one kernel launch (inference only, no autograd).

    Args:
        q: ``[B, T, H_q, K]`` queries, ``H_q = n * H`` (GQA: query head ``h`` reads kv head ``h // n``).
        k: ``[B, T, H, K]`` keys (L2-normalised by the caller).
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-key-channel log-space decay (``<= 0``).
        beta: ``[B, T, H]`` write strength in ``(0, 1)``.
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state entering step 1 (zeros when None).
        output_final_state: return the state after step ``T`` as a new float32 tensor.
        inplace_state: write the final state into ``initial_state`` (contiguous float32) and return it.

    Returns:
        ``(o, state)``: ``o`` ``[B, T, H_q, V]`` in ``v``'s dtype; ``state`` ``[B, H, K, V]`` float32 or None.
    """
    return implementation("recurrent_delta_rule", q.device)(
        q, k, v, g, beta, scale, initial_state, output_final_state, inplace_state,
        per_key_decay=True, op_name="fused_recurrent_kda",
    )
