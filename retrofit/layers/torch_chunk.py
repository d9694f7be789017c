"""Chunked gated delta rule in plain PyTorch (float32, autograd): the CPU path of the converted layers.

Triton kernels have no CPU backend (on CPU they only run through the Triton interpreter, ~20 ms per token and layer),
so on CPU the layers run this implementation of the same chunked form (gated_delta_rule.md, steps 1-6), with the
same signature and GQA convention as ``retrofit.kernels.chunk_gated_delta_rule`` / ``chunk_kda``. On CUDA the layers
call the Triton kernels. tests/test_layers.py checks both against each other and against the recurrent kernels.
"""
from __future__ import annotations

import torch


def chunk_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, chunk_size: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule (GDN: g ``[B, T, H]``; KDA: g ``[B, T, H, K]``), chunk-parallel, differentiable.

    q ``[B, T, H*G, K]`` (query head ``h`` reads kv head ``h // G``), k ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]``, initial_state ``[B, H, K, V]``. Returns (o ``[B, T, H*G, V]`` in v's dtype,
    final state ``[B, H, K, V]`` float32 or None).
    """
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    G = HQ // H
    per_channel = g.dim() == 4
    C = chunk_size or (16 if per_channel else 32)  # per-channel decay builds [C, C, K] blocks: keep them small
    scale = K ** -0.5 if scale is None else scale
    pad = (-T) % C
    f32 = torch.float64 if q.dtype == torch.float64 else torch.float32  # compute dtype

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, *rest] -> [B, H, N, C, *rest]
        x = x.to(f32)
        if pad:
            x = _pad_time(x, pad)
        N = x.shape[1] // C
        x = x.reshape(B, N, C, *x.shape[2:])
        return x.movedim(3, 1)

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

    S = (torch.zeros(B, H, K, V, dtype=f32, device=q.device) if initial_state is None
         else initial_state.to(f32))
    outs = []
    for n in range(N):
        vp = U[:, :, n] - W[:, :, n] @ S  # [B, H, C, V]
        o = q_decayed[:, :, :, n] @ S[:, :, None] + qk[:, :, :, n] @ vp[:, :, None]  # [B, H, G, C, V]
        outs.append(o * scale)
        if per_channel:
            S = torch.exp(last[:, :, n])[..., None] * S + k_to_end[:, :, n].transpose(-1, -2) @ vp
        else:
            S = torch.exp(last[:, :, n])[..., None, None] * S + k_to_end[:, :, n].transpose(-1, -2) @ vp
    o = torch.stack(outs, 3)  # [B, H, G, N, C, V]
    o = o.reshape(B, H, G, N * C, V)[:, :, :, :T].permute(0, 3, 1, 2, 4).reshape(B, T, HQ, V)
    return o.to(v.dtype), (S if output_final_state else None)


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]``.

    A is nilpotent (A^C = 0), so (I + A)^{-1} = (I - A)(I + A^2)(I + A^4)... with log2(C) factors: a few batched
    matmuls instead of a triangular solve (much faster on CPU for many small blocks; differentiable).
    """
    C = A.shape[-1]
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    result = eye - A
    power = A
    span = 2
    while span < C:
        power = power @ power
        result = result @ (eye + power)
        span *= 2
    return result


def _pad_time(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (time) of ``x`` by ``pad``: padded steps have k = v = 0, beta = 0, g = 0 (identity)."""
    shape = list(x.shape)
    shape[1] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=1)
