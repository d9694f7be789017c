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
