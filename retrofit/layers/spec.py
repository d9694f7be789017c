"""What a converted layer is: its hyper-parameters (saved in the hybrid checkpoint) and the head layout of the
attention it replaces."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


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
        window: keys of a short softmax window inside the layer, beside its delta-rule state: each query also
            attends, with the dense attention's own q, k, v, rotation and scaling, to its last ``window`` tokens
            (itself included), and the two outputs are mixed by the window's share of the attention mass
            (``retrofit.layers.window``). Decode keeps a ring of those keys and values in the cache: memory and
            time per token stay constant. 0 = no window (the layer is pure delta rule).
        sink_tokens: the first tokens of a sequence that every query of a windowed layer sees too (StreamingLLM's
            attention sinks); only with ``window`` > 0.
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
    window: int = 0
    sink_tokens: int = 0

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
        for name in ("window", "sink_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.sink_tokens and not self.window:
            raise ValueError(f"sink_tokens {self.sink_tokens} needs a window (window > 0)")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "LinearAttentionSpec":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass(frozen=True)
class AttentionShape:
    """Head layout of the softmax attention a layer replaces, as the family's architecture record gives it for a
    config (:func:`AttentionShape.from_config`).

    ``qkv_bias`` / ``o_bias``: whether q, k, v (and o) have biases. ``qk_norm``: the dense attention normalises q and
    k after projecting them, RMSNorm over each head (``"head"``) or over the whole projection (``"projection"``),
    with the weight applied as ``1 + w`` where ``qk_norm_unit_offset``; the converted layer keeps that norm (its
    weights copied) before its convolution. ``rotary_dims``: the channels of each head the dense model rotates
    (what ``use_rope`` rotates), ``rotary_interleaved``: rotation of adjacent pairs rather than halves."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    qk_norm_eps: float = 1e-6
    qk_norm_unit_offset: bool = False
    rotary_dims: int | None = None
    rotary_interleaved: bool = False

    def __post_init__(self):
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {self.qk_norm!r}")

    @classmethod
    def from_config(cls, config) -> "AttentionShape":
        """The shape of ``config``'s attention, read from its family's architecture record."""
        from retrofit import architecture

        arch = architecture.of(config)
        text = architecture.text_config(config)
        qkv_bias, o_bias = arch.biases(text)
        norm = arch.qk_norm_of(text)
        full = [layer.rotary_dims for layer in arch.layers(text) if layer.rotary_dims]
        return cls(text.hidden_size, arch.num_heads(text), arch.num_kv_heads(text), arch.head_dim(text),
                   qkv_bias=bool(qkv_bias), o_bias=bool(o_bias), qk_norm=None if norm is None else norm.per,
                   qk_norm_eps=float(norm.eps(text)) if norm is not None else 1e-6,
                   qk_norm_unit_offset=bool(norm and norm.unit_offset), rotary_dims=max(full) if full else 0,
                   rotary_interleaved=arch.rotary_interleaved)
