"""Linear-attention layers that replace a dense model's ``self_attn``: Gated DeltaNet (``gdn``) and KDA (``kda``)."""
from retrofit.layers.common import AttentionShape, LinearAttentionSpec
from retrofit.layers.gated_deltanet import GatedDeltaNetAttention
from retrofit.layers.kda import KimiDeltaAttention
from retrofit.registry import Registry

LAYER_TYPES: Registry = Registry("layer type")
LAYER_TYPES.register("gdn")(GatedDeltaNetAttention)
LAYER_TYPES.register("kda")(KimiDeltaAttention)

__all__ = ["AttentionShape", "LinearAttentionSpec", "GatedDeltaNetAttention", "KimiDeltaAttention", "LAYER_TYPES"]
