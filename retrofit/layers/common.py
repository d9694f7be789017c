"""Pieces shared by the Gated DeltaNet and KDA attention layers: hyper-parameters, the short causal convolution,
the gated output norm, padding masks and the generation-cache plumbing for linear-attention states."""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn


@dataclass
class LinearAttentionSpec:
    """Hyper-parameters of a converted (linear-attention) layer; saved in the hybrid checkpoint's ``retrofit`` section.

    Attributes:
        conv_size: width of the short causal depthwise convolution on q, k, v (4 in GDN / KDA).
        decay_min, decay_max: range of the initial per-token decay time step ``dt`` (``g = -exp(A_log) * dt``);
            small values mean slow forgetting (long memory) at initialisation.
        beta_init: initial write strength ``beta`` (sigmoid of the bias of ``b_proj``).
        gate_init: initial output gate value (sigmoid of the bias of the gate projection), near 1 so that
            the converted layer starts as "norm(o) then W_o".
        gate_rank: rank of KDA's low-rank decay and output-gate projections (0 = head_dim).
        gate_lower_bound: KDA's per-channel log decay is clamped from below at this value (kernel numerics).
        use_rope: apply the dense model's rotary embedding to q, k before the kernel (off in GDN / KDA).
        expand_kv: give every query head its own key/value head (more state) instead of one state per kv head.
    """

    conv_size: int = 4
    decay_min: float = 0.001
    decay_max: float = 0.1
    beta_init: float = 0.5
    gate_init: float = 0.95
    gate_rank: int = 0
    gate_lower_bound: float = -5.0
    use_rope: bool = False
    expand_kv: bool = False

    def __post_init__(self):
        if self.conv_size < 2:
            raise ValueError(f"conv_size must be >= 2, got {self.conv_size}")
        if not 0 < self.decay_min <= self.decay_max:
            raise ValueError(f"need 0 < decay_min <= decay_max, got {self.decay_min}, {self.decay_max}")
        for name in ("beta_init", "gate_init"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        if self.gate_lower_bound >= 0:
            raise ValueError(f"gate_lower_bound must be negative, got {self.gate_lower_bound}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "LinearAttentionSpec":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass(frozen=True)
class AttentionShape:
    """Head layout of the attention a layer replaces (taken from the dense model's config)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False

    @classmethod
    def from_config(cls, config) -> "AttentionShape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                   bool(getattr(config, "attention_bias", False)))


_KERNEL_MODULES = {
    "chunk_gated_delta_rule": "retrofit.kernels.gated_delta_rule.chunk",
    "chunk_kda": "retrofit.kernels.kda.chunk",
}


def kernel(name: str):
    """The Triton kernel ``retrofit.kernels.<name>`` (looked up at call time: the kernel package is imported lazily)."""
    import importlib

    import retrofit.kernels as kernels

    found = getattr(kernels, name, None)
    if found is None and name in _KERNEL_MODULES:
        found = getattr(importlib.import_module(_KERNEL_MODULES[name]), name, None)
    if found is None:
        raise RuntimeError(f"retrofit.kernels has no {name}: the kernel package is incomplete")
    return found


BACKENDS = ("auto", "triton", "torch")
_backend_override: list[str] = []


def linear_backend(device: torch.device) -> str:
    """Which implementation the converted layers run: ``triton`` (the project's kernels) or ``torch``.

    ``auto`` (default; ``RETROFIT_LINEAR_BACKEND`` or :func:`use_backend` override it) picks Triton on CUDA and the
    PyTorch chunked form on CPU, where Triton only has its (very slow) interpreter.
    """
    choice = _backend_override[-1] if _backend_override else os.environ.get("RETROFIT_LINEAR_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"RETROFIT_LINEAR_BACKEND must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


@contextlib.contextmanager
def use_backend(name: str):
    """Force the converted layers' backend (``triton``, ``torch`` or ``auto``) inside a ``with`` block."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    _backend_override.append(name)
    try:
        yield
    finally:
        _backend_override.pop()


def delta_rule_op(per_channel: bool, decode: bool, device: torch.device):
    """The delta-rule function for this call: Triton chunk (prefill/training) or recurrent (decode) kernels, or the
    PyTorch chunked form; all share the signature ``(q, k, v, g, beta, scale, initial_state, output_final_state)``."""
    if linear_backend(device) == "torch":
        from retrofit.layers.torch_chunk import chunk_delta_rule_torch

        return chunk_delta_rule_torch
    if decode:
        return kernel("fused_recurrent_kda" if per_channel else "fused_recurrent_gated_delta_rule")
    return kernel("chunk_kda" if per_channel else "chunk_gated_delta_rule")


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
        prefix = "naive_" if linear_backend(x.device) == "torch" else ""
        weight, bias = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if decode and state is not None and x.shape[1] == 1:
            state = state.clone()
            y = kernel(prefix + "causal_conv1d_update")(x[:, 0], state, weight, bias, "silu")
            return y.reshape(x.shape), state
        y, new_state = kernel(prefix + "causal_conv1d")(x, weight, bias, activation="silu", initial_state=state,
                                                        output_final_state=True)
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
        dtype = o.dtype
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        return (of * self.weight.float() * gate.float()).to(dtype)


def padding_mask(attention_mask, batch: int, length: int, device) -> torch.Tensor | None:
    """Which of the ``length`` current positions are real tokens: bool ``[B, T]``, or None when none is padded.

    Accepts the forms transformers hands to an attention module: None, a 2-D ``[B, S]`` 0/1 mask, or a 4-D
    ``[B, 1, T, S]`` (bool "may attend" or additive float) mask; for 4-D the diagonal of the last T key columns
    tells whether a position may attend to itself, i.e. whether it is a real token.
    """
    if attention_mask is None or isinstance(attention_mask, dict):
        return None
    m = attention_mask
    if m.dim() == 2:
        keep = m[:, -length:].bool()
    elif m.dim() == 4:
        square = m[:, 0, -length:, -length:]
        diag = torch.diagonal(square, dim1=-2, dim2=-1)
        keep = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
        if keep.shape[0] != batch:
            keep = keep.expand(batch, -1)
    else:
        return None
    keep = keep.to(device)
    if bool(keep.all()):
        return None
    return keep


def cache_states(cache, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv state ``[B, D, W-1]``, recurrent state ``[B, H, K, V]``) of a layer from a transformers Cache, or Nones."""
    if cache is None:
        return None, None
    layer = _linear_cache_layer(cache, layer_idx)
    if not layer.has_previous_state[0]:
        return None, None
    return layer.conv_states[0], layer.recurrent_states[0]


def store_states(cache, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
    """Write a layer's new conv and recurrent states into the cache (in place once allocated)."""
    layer = _linear_cache_layer(cache, layer_idx)
    layer.update_conv_state(conv_state, 0, conv_kernel_size=conv_state.shape[-1])
    layer.update_recurrent_state(recurrent_state, 0)


def _linear_cache_layer(cache, layer_idx: int):
    """The cache's layer object for ``layer_idx``, made a linear-attention layer if the cache was built without
    the hybrid config (e.g. a bare ``DynamicCache()``)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    if not isinstance(layers[layer_idx], LinearAttentionCacheLayerMixin):
        layers[layer_idx] = LinearAttentionLayer()
    return layers[layer_idx]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x ``[..., K]`` -> x / ||x||, in fp32 for the norm."""
    return (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(q: torch.Tensor, k: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the dense model's rotary embedding to q ``[B, T, Hq, D]`` and k ``[B, T, Hk, D]``."""
    cos, sin = position_embeddings
    cos, sin = cos[:, :, None, :].to(q.dtype), sin[:, :, None, :].to(q.dtype)

    def half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + half(q) * sin, k * cos + half(k) * sin
