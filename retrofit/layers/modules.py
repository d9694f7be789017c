"""Small modules and functions shared by the delta-rule layers: the short causal convolution, the gated output norm,
rotary embedding, and the initial decay (the L2 norm and the gates' math: ``retrofit.kernels`` references)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from retrofit.kernels import causal_conv1d, causal_conv1d_update, gated_rms_norm_ref
from retrofit.layers.spec import LinearAttentionSpec


def logit(p: float) -> float:
    return math.log(p / (1 - p))


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def init_decay(A_log: nn.Parameter, dt_bias: nn.Parameter, spec: LinearAttentionSpec, repeat: int = 1) -> None:
    """``A = 1`` and ``dt`` log-uniform in [decay_min, decay_max]: ``g = -dt`` at init (slow decay, several time scales).

    ``dt_bias`` is ``[H_kv]`` (GDN) or ``[H_kv * K]`` (KDA). With ``repeat > 1`` (kv heads expanded to query heads)
    each group of ``repeat`` heads gets the values of the kv head it copies, so the expanded layer computes the same
    function as the grouped one at initialisation.
    """
    with torch.no_grad():
        A_log.zero_()
        rows = dt_bias.view(A_log.shape[0], -1)
        base_shape = (rows.shape[0] // repeat, rows.shape[1])
        u = torch.rand(base_shape, generator=torch.Generator().manual_seed(0))
        lo, hi = math.log(spec.decay_min), math.log(spec.decay_max)
        dt = torch.exp(lo + u * (hi - lo)).repeat_interleave(repeat, dim=0)
        rows.copy_(inverse_softplus(dt))


class ShortConvolution(nn.Module):
    """Causal depthwise convolution of width W with SiLU over ``[B, T, D]`` features, carrying ``[B, D, W-1]`` state.

    Initialised as the identity (only the current-token tap is 1), so ``silu(x)`` at start.
    """

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.channels, self.width = channels, width
        self.weight = nn.Parameter(torch.zeros(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[:, -1] = 1.0
            self.bias.zero_()

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, decode: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[B, T, D]`` -> (silu(conv(x)) ``[B, T, D]``, new state ``[B, D, W-1]``)."""
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if decode and state is not None and x.shape[1] == 1:
            state = state.clone()
            y = causal_conv1d_update(x[:, 0], state, weight, bias, "silu")
            return y.reshape(x.shape), state
        y, new_state = causal_conv1d(x, weight, bias, activation="silu", initial_state=state, output_final_state=True)
        return y, new_state


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the kernel output followed by a multiplicative gate: ``w_h * o / rms(o) * gate``.

    The weight ``[H, D]`` is per head, so the norm can start at the per-head scale of the dense attention output.
    """

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads, head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o ``[B, T, H, D]``, gate ``[B, T, H, D]`` (already through its activation) -> ``[B, T, H, D]``."""
        return gated_rms_norm_ref(o, gate, self.weight, self.eps)



def rotate(q: torch.Tensor, k: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the dense model's rotary embedding to q ``[B, T, Hq, D]`` and k ``[B, T, Hk, D]``: halves rotated
    against each other (Llama's convention) over the first ``R`` channels of each head, ``R`` the width of the
    model's ``cos, sin [B, T, R]`` (partial rotary leaves the rest as they are)."""
    cos, sin = position_embeddings
    cos, sin = cos[:, :, None, :].to(q.dtype), sin[:, :, None, :].to(q.dtype)
    width = cos.shape[-1]

    def half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def rotated(x):
        turned = x[..., :width] * cos + half(x[..., :width]) * sin
        return turned if width == x.shape[-1] else torch.cat((turned, x[..., width:]), dim=-1)

    return rotated(q), rotated(k)


class ProjectionNorm(nn.Module):
    """RMSNorm over the last dimension with a weight ``[dim]`` applied as ``w`` or ``1 + w`` (``unit_offset``, Gemma):
    the dense attention's q/k norm, carried into a converted layer. Statistics in float32, as transformers' norms."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., dim]`` -> ``[...,  dim]`` in x's dtype."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.float()
        return (x * (1.0 + weight if self.unit_offset else weight)).to(dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.unit_offset else 1.0)
