"""The gated delta rule in plain PyTorch, shared by GDN (scalar decay) and KDA (per-channel): the references the
Triton kernels are tested against and the PyTorch paths ``backend.py`` runs where Triton does not.

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


def recurrent_delta_rule_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               inplace_state=False, per_key_decay=False, op_name="recurrent delta rule"):
    """The PyTorch path of the recurrent ops (``fused_recurrent_*``): :func:`naive_recurrent` in float32, with the
    kernels' ``inplace_state`` contract (the final state written into ``initial_state`` and returned)."""
    if inplace_state and (initial_state is None or initial_state.dtype != torch.float32):
        raise ValueError(f"{op_name}: inplace_state=True needs a float32 initial_state (the buffer to update)")
    o, state = naive_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state or inplace_state,
                               per_channel=per_key_decay)
    if inplace_state:
        initial_state.copy_(state)
        return o, initial_state
    return o, (state.float() if state is not None else None)


def chunk_delta_rule_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           per_channel=False, chunk_size=None, compute_dtype=None):
    """The chunked form of the gated delta rule in plain PyTorch (autograd): the PyTorch path of the chunk ops
    and, in float64, the specification they are tested against (:func:`naive_chunk`).

    Same arguments and GQA convention as ``chunk_gated_delta_rule`` (per_channel=False, g ``[B, T, H]``) and
    ``chunk_kda`` (per_channel=True, g ``[B, T, H, K]``); computes in ``compute_dtype`` (default float32, float64 if
    any input is float64) over chunks of ``chunk_size`` (default 16 per-channel, whose ``[C, C, K]`` decay blocks
    grow with C, else 32). Returns (o ``[B, T, Hq, V]`` in v's dtype, final state ``[B, H, K, V]`` float32 —
    float64 if any input is — or None).
    """
    _check(q, k, v, g, beta, initial_state, per_channel)
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    G = HQ // H
    out_state_dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    f = compute_dtype or out_state_dtype
    C = chunk_size or (16 if per_channel else 32)
    scale = K ** -0.5 if scale is None else scale
    if T == 0:
        state = initial_state.to(out_state_dtype).clone() if initial_state is not None else q.new_zeros(
            B, H, K, V, dtype=out_state_dtype)
        return v.new_zeros(B, 0, HQ, V), (state if output_final_state else None)
    pad = (-T) % C

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, *rest] -> [B, H, N, C, *rest]; padded steps (k = v = 0, beta = 0, g = 0) leave the state as is
        x = x.to(f)
        if pad:
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
        return x.reshape(B, x.shape[1] // C, C, *x.shape[2:]).movedim(3, 1)

    qc = chunks(q.view(B, T, H, G, K)).movedim(4, 2)  # [B, H, G, N, C, K]
    kc, vc = chunks(k), chunks(v)  # [B, H, N, C, K/V]
    bc = chunks(beta)  # [B, H, N, C]
    gc = chunks(g)  # [B, H, N, C(, K)]
    N = kc.shape[2]
    Gc = gc.cumsum(3)  # cumulative log decay inside each chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)

    if per_channel:
        diff = Gc[..., :, None, :] - Gc[..., None, :, :]  # [B, H, N, C, C, K]
        decay = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))
        A = torch.einsum("bhnic,bhnjc,bhnijc->bhnij", kc, kc, decay)
        qk = torch.einsum("bhgnic,bhnjc,bhnijc->bhgnij", qc, kc, decay)
        k_decayed = kc * torch.exp(Gc)
        q_decayed = qc * torch.exp(Gc)[:, :, None]
        last = Gc[..., -1, :]  # [B, H, N, K]
        k_to_end = kc * torch.exp(last[..., None, :] - Gc)
    else:
        diff = Gc[..., :, None] - Gc[..., None, :]  # [B, H, N, C, C]
        decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
        A = (kc @ kc.transpose(-1, -2)) * decay
        qk = (qc @ kc[:, :, None].transpose(-1, -2)) * decay[:, :, None]
        k_decayed = kc * torch.exp(Gc)[..., None]
        q_decayed = qc * torch.exp(Gc)[:, :, None, ..., None]
        last = Gc[..., -1]  # [B, H, N]
        k_to_end = kc * torch.exp(last[..., None] - Gc)[..., None]
    A = (A * bc[..., None]).masked_fill(~strict, 0.0)
    Tm = unit_lower_inverse(A)
    W = Tm @ (bc[..., None] * k_decayed)  # [B, H, N, C, K]
    U = Tm @ (bc[..., None] * vc)  # [B, H, N, C, V]
    qk = qk.masked_fill(~causal, 0.0)

    S = torch.zeros(B, H, K, V, dtype=f, device=q.device) if initial_state is None else initial_state.to(f)
    outs = []
    for n in range(N):
        vp = U[:, :, n] - W[:, :, n] @ S  # [B, H, C, V]
        o = q_decayed[:, :, :, n] @ S[:, :, None] + qk[:, :, :, n] @ vp[:, :, None]  # [B, H, G, C, V]
        outs.append(o * scale)
        decay_to_end = torch.exp(last[:, :, n])[..., None] if per_channel else torch.exp(last[:, :, n])[..., None, None]
        S = decay_to_end * S + k_to_end[:, :, n].transpose(-1, -2) @ vp
    o = torch.stack(outs, 3)  # [B, H, G, N, C, V]
    o = o.reshape(B, H, G, N * C, V)[:, :, :, :T].permute(0, 3, 1, 2, 4).reshape(B, T, HQ, V)
    return o.to(v.dtype), (S.to(out_state_dtype) if output_final_state else None)


def naive_chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                per_channel=False, chunk_size=64):
    """The chunked specification of gated_delta_rule.md in float64: :func:`chunk_delta_rule_torch` computing in
    float64. Returns (o in v's dtype, final state in float32 — float64 if any input is float64 — or None)."""
    return chunk_delta_rule_torch(q, k, v, g, beta, scale, initial_state, output_final_state, per_channel=per_channel,
                                  chunk_size=chunk_size, compute_dtype=torch.float64)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]``, by forward substitution (differentiable).

    A triangular solve keeps float32 accurate to ~1e-7 for every chunk size: the nilpotent product
    (I - A)(I + A^2)(I + A^4)... it replaced cancels catastrophically in float32 (relative errors of 4e-5 at C = 32
    and 2e-4 at C = 64 on SmolLM2's layer inputs) and was no faster on the CPU.
    """
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)


def l2_normalize_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x ``[..., K]`` -> x / ||x|| over the last dim, the norm in fp32, the result in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def log_decay_ref(logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, per_key_decay: bool,
                  lower_bound: float | None = None) -> torch.Tensor:
    """The log decay of GDN and KDA, ``g = -exp(A_log) * softplus(logits + dt_bias)`` in fp32 (<= 0), clamped from
    below at ``lower_bound`` when given (KDA).

    GDN: logits [..., H], A_log [H], dt_bias [H] -> g [..., H]. KDA (``per_key_decay``): logits [..., H, K],
    A_log [H], dt_bias [H * K] -> g [..., H, K].
    """
    H = A_log.shape[0]
    bias = dt_bias.float().view(H, -1) if per_key_decay else dt_bias.float()
    rate = A_log.float().exp()
    g = -(rate[:, None] if per_key_decay else rate) * torch.nn.functional.softplus(logits.float() + bias)
    return g if lower_bound is None else g.clamp(min=lower_bound)


def delta_rule_decode_step_ref(qkv: torch.Tensor, decay_logits: torch.Tensor, beta_logits: torch.Tensor,
                               A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, num_heads: int,
                               per_key_decay: bool, lower_bound: float | None = None,
                               scale: float | None = None) -> torch.Tensor:
    """One decode token of a GDN or KDA layer after its short conv, the state updated in place.

    qkv [B, (Hq + 2 H) D] (the conv's output: queries, keys, values), decay_logits [B, H] (GDN) or [B, H * D] (KDA),
    beta_logits [B, H], A_log [H], dt_bias [H] or [H * D], state [B, H, D, D] float32 -> o [B, Hq, D] in qkv's dtype:
    q and k L2-normalised (:func:`l2_normalize_ref`), ``beta = sigmoid(beta_logits)``, ``g`` by
    :func:`log_decay_ref`, then one step of the recurrence (:func:`recurrent_delta_rule_torch`).
    """
    B = qkv.shape[0]
    H, D = state.shape[1], state.shape[2]
    q, k, v = qkv.view(B, 1, -1).split([num_heads * D, H * D, H * D], dim=-1)
    q, k = l2_normalize_ref(q.reshape(B, 1, num_heads, D)), l2_normalize_ref(k.reshape(B, 1, H, D))
    logits = decay_logits.view(B, 1, H, D) if per_key_decay else decay_logits.view(B, 1, H)
    g = log_decay_ref(logits, A_log, dt_bias, per_key_decay, lower_bound)
    beta = torch.sigmoid(beta_logits.float()).view(B, 1, H)
    o, _ = recurrent_delta_rule_torch(q, k, v.reshape(B, 1, H, D), g, beta, scale, state, inplace_state=True,
                                      per_key_decay=per_key_decay)
    return o[:, 0]
