"""Pure-PyTorch references of the gated delta rule, shared by GDN (scalar decay) and KDA (per-channel).

Shapes follow flash-linear-attention: q [B, T, Hq, K], k [B, T, H, K], v [B, T, H, V],
g [B, T, H] (GDN) or [B, T, H, K] (KDA) log-space decay (<= 0), beta [B, T, H], state [B, H, K, V].
Hq is a multiple of H (grouped query heads): query head ``h`` reads the state of kv head ``h // (Hq // H)``.

Recurrence per kv head (the math of shared/design/gated_delta_rule.md):
    S <- exp(g_t) * S                 (KDA: Diag(exp(g_t)) S)
    u_t = beta_t * (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = scale * S^T q_t
"""
from __future__ import annotations

import torch


def _check(q, k, v, g, beta, initial_state, per_channel):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: [B, T, H, K] / [B, T, H, V]")
    B, T, Hq, K = q.shape
    H = k.shape[2]
    if k.shape != (B, T, H, K):
        raise ValueError(f"k: expected shape {(B, T, H, K)}, got {tuple(k.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected shape {(B, T, H)} + (V,), got {tuple(v.shape)}")
    if Hq % H != 0:
        raise ValueError(f"q: head count {Hq} must be a multiple of k's head count {H}")
    gshape = (B, T, H, K) if per_channel else (B, T, H)
    if tuple(g.shape) != gshape:
        raise ValueError(f"g: expected shape {gshape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta: expected shape {(B, T, H)}, got {tuple(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state: expected shape {(B, H, K, v.shape[-1])}, got {tuple(initial_state.shape)}")


def _compute_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def naive_recurrent(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    per_channel=False):
    """One token at a time, in float32 (float64 if any input is float64). Returns (o, final_state|None)."""
    _check(q, k, v, g, beta, initial_state, per_channel)
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    n = Hq // H
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q = q.view(B, T, H, n, K)
    if initial_state is None:
        S = q.new_zeros(B, H, K, V)
    else:
        S = initial_state.to(dt)
    outs = []
    for t in range(T):
        decay = torch.exp(g[:, t])                                  # [B, H] or [B, H, K]
        S = S * (decay[..., None] if per_channel else decay[..., None, None])
        kt = k[:, t]                                                # [B, H, K]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S))
        S = S + kt[..., None] * u[..., None, :]
        outs.append(scale * torch.einsum("bhnk,bhkv->bhnv", q[:, t], S).reshape(B, Hq, V))
    o = torch.stack(outs, 1) if T > 0 else q.new_zeros(B, 0, Hq, V)
    return o.to(v.dtype), (S if output_final_state else None)


def naive_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                per_channel=False, chunk_size=64):
    """The chunked specification of gated_delta_rule.md, in float64, batched over B and heads.

    Returns (o in v's dtype, final state in float32 — float64 if any input is float64 — or None).
    """
    _check(q, k, v, g, beta, initial_state, per_channel)
    out_state_dt = _compute_dtype(q, k, v, g, beta, initial_state)
    f64 = torch.float64
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    n = Hq // H
    C = chunk_size
    if scale is None:
        scale = K ** -0.5
    # [B, H, T, ...]; q -> [B, H, n, T, K]
    Q = q.to(f64).view(B, T, H, n, K).permute(0, 2, 3, 1, 4)
    Kk = k.to(f64).transpose(1, 2)
    Vv = v.to(f64).transpose(1, 2)
    gg = g.to(f64).transpose(1, 2)
    if not per_channel:
        gg = gg[..., None]                                          # [B, H, T, 1]
    bb = beta.to(f64).transpose(1, 2)                               # [B, H, T]
    S = (initial_state.to(f64) if initial_state is not None else Q.new_zeros(B, H, K, V))
    outs = []
    for s in range(0, T, C):
        Qc, Kc, Vc, Bc, gc = Q[:, :, :, s:s + C], Kk[:, :, s:s + C], Vv[:, :, s:s + C], bb[:, :, s:s + C], gg[:, :, s:s + C]
        L = Kc.shape[2]
        G = gc.cumsum(2)                                            # [B, H, L, 1|K]
        causal_m = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        strict_m = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]            # [B, H, L, L, 1|K]
        D = torch.exp(torch.where(causal_m[:, :, None], diff, torch.full_like(diff, float("-inf"))))
        D = D.expand(B, H, L, L, K)
        A = Bc[..., None] * torch.einsum("bhic,bhjc,bhijc->bhij", Kc, Kc, D) * strict_m
        Tm = torch.linalg.inv(torch.eye(L, dtype=f64, device=q.device) + A)
        W = Tm @ (Bc[..., None] * torch.exp(G) * Kc)
        U = Tm @ (Bc[..., None] * Vc)
        Vp = U - W @ S                                              # [B, H, L, V]
        M = torch.einsum("bhnic,bhjc,bhijc->bhnij", Qc, Kc, D) * causal_m
        eG = torch.exp(G)[:, :, None]                               # [B, H, 1, L, 1|K]
        o = scale * ((Qc * eG) @ S[:, :, None] + M @ Vp[:, :, None])  # [B, H, n, L, V]
        outs.append(o)
        Gl = G[:, :, -1]                                            # [B, H, 1|K]
        S = torch.exp(Gl)[..., None] * S + (Kc * torch.exp(Gl[:, :, None, :] - G)).transpose(-1, -2) @ Vp
    if T > 0:
        o = torch.cat(outs, 3)                                      # [B, H, n, T, V]
    else:
        o = Q.new_zeros(B, H, n, 0, V)
    o = o.permute(0, 3, 1, 2, 4).reshape(B, T, Hq, V).to(v.dtype)
    return o, (S.to(out_state_dt) if output_final_state else None)
