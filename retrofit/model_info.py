"""What a causal LM's attention looks like: the layout retrofit needs to patch or convert it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from retrofit.errors import RetrofitError

SOFTMAX_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class AttentionLayout:
    """Per-model attention facts. ``layer_types[i]`` is e.g. ``full_attention``, ``sliding_attention``, ``gdn``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int | None
    layer_types: list[str]
    attention_modules: list[nn.Module] = field(repr=False)

    @property
    def softmax_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind.endswith("attention")]

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes a KV cache holds per token (keys and values of every softmax layer)."""
        return 2 * len(self.softmax_layers) * self.num_kv_heads * self.head_dim * element_bytes


def model_device(model: nn.Module):
    """The device of the model's (first) parameters."""
    return next(model.parameters()).device


def max_model_length(model: nn.Module) -> int:
    """The model's position limit (``config.max_position_embeddings``), or a very large number if unknown."""
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Llama/Qwen2/Mistral-style causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RetrofitError(f"{type(model).__name__} has no decoder layers at model.model.layers; "
                            "retrofit supports Llama/Qwen2/Mistral-style causal LMs")
    return layers


def attention_layout(model: nn.Module) -> AttentionLayout:
    """Read the attention layout, raising :class:`RetrofitError` naming the module that does not fit."""
    config = model.config
    layers = decoder_layers(model)
    modules, kinds = [], []
    config_types = getattr(config, "layer_types", None) or ["full_attention"] * len(layers)
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise RetrofitError(f"layer {index} ({type(layer).__name__}) has no self_attn module; "
                                "retrofit supports Llama/Qwen2/Mistral-style decoder layers")
        converted = getattr(attn, "retrofit_layer_type", None)
        if converted is None:
            missing = [name for name in SOFTMAX_PROJECTIONS if not isinstance(getattr(attn, name, None), nn.Linear)]
            if missing:
                raise RetrofitError(f"unsupported attention module {type(attn).__name__} at model.layers.{index}."
                                    f"self_attn: it lacks {', '.join(missing)} (need separate q/k/v/o projections)")
        modules.append(attn)
        kinds.append(converted or config_types[index])
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return AttentionLayout(
        num_layers=len(layers),
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        max_positions=getattr(config, "max_position_embeddings", None),
        layer_types=kinds,
        attention_modules=modules,
    )
