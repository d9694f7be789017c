"""A loaded model's attention, per layer, from its family's architecture record (:mod:`retrofit.architecture`):
the layout retrofit needs to patch, convert or size it."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Iterable

import torch.nn as nn

from retrofit import architecture
from retrofit.architecture import Architecture, LayerAttention
from retrofit.errors import RetrofitError

SOFTMAX_KINDS = ("full_attention", "sliding_attention")


@dataclass
class AttentionLayout:
    """Per-model attention facts. ``layer_types[i]``: ``full_attention``, ``sliding_attention``, ``linear_attention``
    (a family's native recurrent layer) or a converted layer's type (``gdn``, ``kda``); ``layers[i]`` the record's
    :class:`LayerAttention` of the dense layer (window, softcap, scaling, rotary dims)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int | None
    layer_types: list[str]
    attention_modules: list[nn.Module] = field(repr=False)
    layers: list[LayerAttention] = field(default_factory=list, repr=False)
    architecture: Architecture | None = field(default=None, repr=False)

    @property
    def interfaced(self) -> bool:
        """Whether every softmax layer computes its attention through transformers' attention interface
        (``ALL_ATTENTION_FUNCTIONS``), which generation and sparse decoding run their own attention through. Some
        families came to it later than others (Falcon after transformers 5.17)."""
        return all(hasattr(sys.modules[type(self.attention_modules[i]).__module__], "ALL_ATTENTION_FUNCTIONS")
                   for i in self.softmax_layers)

    def require_interface(self, purpose: str) -> None:
        """RetrofitError (one line) unless :attr:`interfaced`."""
        if not self.interfaced:
            import transformers

            family, release = self.architecture.model_type, transformers.__version__
            raise RetrofitError(f"{family}'s attention in transformers {release} "
                                f"is computed outside transformers' attention interface, which {purpose} needs; "
                                "a newer transformers release routes it through the interface")

    @property
    def softmax_layers(self) -> list[int]:
        """Layers that run softmax attention now (sliding-window ones included; converted ones not)."""
        return [i for i, kind in enumerate(self.layer_types) if kind in SOFTMAX_KINDS]

    @property
    def unbounded_layers(self) -> list[int]:
        """Softmax layers whose key-value cache grows with the context (no sliding window)."""
        return [i for i in self.softmax_layers if self.layers[i].window is None]

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i in self.softmax_layers if self.layers[i].window is not None]

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes the key-value cache grows by per token: keys and values of every unbounded softmax layer."""
        return 2 * len(self.unbounded_layers) * self.num_kv_heads * self.head_dim * element_bytes

    def window_bytes(self, element_bytes: int, batch: int = 1) -> int:
        """Bytes the sliding-window layers hold once their windows are full (bounded, whatever the context)."""
        per_position = 2 * self.num_kv_heads * self.head_dim * element_bytes * batch
        return sum(self.layers[i].window * per_position for i in self.sliding_layers)


def model_device(model: nn.Module):
    """The device of the model's (first) parameters."""
    return next(model.parameters()).device


def max_model_length(model: nn.Module) -> int:
    """The model's position limit (``config.max_position_embeddings``), or a very large number if unknown."""
    return int(getattr(architecture.text_config(model), "max_position_embeddings", None) or 1 << 30)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a causal LM of a described family (RetrofitError for others)."""
    return architecture.of(model).blocks(model)


def attention_layout(model: nn.Module) -> AttentionLayout:
    """Read the attention layout, raising :class:`RetrofitError` (one line) for a family retrofit does not describe
    or a softmax attention module that is not what its family's record says (naming the module)."""
    arch = architecture.of(model)
    config = architecture.text_config(model)
    described = arch.layers(config)
    blocks = arch.blocks(model)
    if len(blocks) != len(described):
        raise RetrofitError(f"{type(model).__name__} has {len(blocks)} decoder layers, its config "
                            f"{len(described)}")
    projections = arch.attention_projection_names(config)
    modules, kinds = [], []
    for layer, block in zip(described, blocks):
        attention = getattr(block, arch.attention, None)
        if attention is None:  # a native linear-attention layer (Qwen3-Next's) lives elsewhere in its block
            kinds.append(layer.kind)
            modules.append(None)
            continue
        converted = getattr(attention, "retrofit_layer_type", None)
        if converted is None and layer.softmax:
            missing = [name for name in projections if not isinstance(getattr(attention, name, None), nn.Module)]
            if missing:
                raise RetrofitError(f"unsupported attention module {type(attention).__name__} at "
                                    f"{arch.block_prefix(layer.index)}{arch.attention}: it lacks {', '.join(missing)} "
                                    f"(the {arch.model_type} record says {arch.qkv_layout(config).describe()})")
        modules.append(attention)
        kinds.append(converted or layer.kind)
    return AttentionLayout(
        num_layers=len(blocks),
        num_heads=arch.num_heads(config),
        num_kv_heads=arch.num_kv_heads(config),
        head_dim=arch.head_dim(config),
        hidden_size=config.hidden_size,
        max_positions=getattr(config, "max_position_embeddings", None),
        layer_types=kinds,
        attention_modules=modules,
        layers=described,
        architecture=arch,
    )


def restrict_layers(layers: Iterable[int] | str, eligible: Iterable[int], what: str) -> list[int]:
    """``layers`` (indices, or "0,1,2" from the CLI) sorted, without repeats, each one of ``eligible``; RetrofitError
    (one line) for unparsable text or a layer outside ``eligible``, which ``what`` names (e.g. "softmax-attention
    layers of LlamaForCausalLM")."""
    if isinstance(layers, str):
        try:
            layers = [int(part) for part in layers.split(",") if part.strip()]
        except ValueError:
            raise RetrofitError(f"layers={layers!r} is invalid: expected comma-separated layer indices") from None
    allowed = sorted(set(eligible))
    chosen = sorted({int(i) for i in layers})
    unknown = [i for i in chosen if i not in allowed]
    if unknown:
        raise RetrofitError(f"layers={unknown} are not {what} (those are {allowed})")
    return chosen
