"""Linear-attention layers that replace a dense model's ``self_attn``: Gated DeltaNet (``gdn``) and Kimi Delta
Attention (``kda``).

``spec.py`` (hyper-parameters, head layout), ``modules.py`` (conv, gated norm, small functions), ``state.py``
(padding and the cache's linear-attention states), ``delta_rule.py`` (the forward the delta-rule family shares),
then one small file per layer type. To add a layer type:

1. Write ``retrofit/layers/<name>.py``: a :class:`DeltaRuleAttention` subclass naming its ``chunk_op`` (prefill,
   training) and ``recurrent_op`` (decode) from ``retrofit.kernels``, whether its decay is per key channel
   (``per_key_decay``), and defining its gates and their initialisation (``_build_gates``, ``reset_gates``,
   ``decay_logits``, ``output_gate_logits``, ``gate_input_projections``). A layer of another family needs
   only the same forward signature and cache contract (``state.py``).
2. Register it below: ``LAYER_TYPES.register("<name>")(<Name>Attention)``. `retrofit convert --to <name>`, the hybrid
   checkpoint (``retrofit.hybrid``) and the tests parametrised over ``LAYER_TYPES`` pick it up from there.
3. Give its ops a Triton kernel and a PyTorch reference under ``kernels/<op>/`` and an entry in
   ``retrofit.kernels.backend.OPS``, with the kernel tests beside the others.
"""
from retrofit.layers.delta_rule import DeltaRuleAttention
from retrofit.layers.gated_deltanet import GatedDeltaNetAttention
from retrofit.layers.kda import KimiDeltaAttention
from retrofit.layers.spec import AttentionShape, LinearAttentionSpec
from retrofit.registry import Registry

LAYER_TYPES: Registry = Registry("layer type")
LAYER_TYPES.register("gdn")(GatedDeltaNetAttention)
LAYER_TYPES.register("kda")(KimiDeltaAttention)

__all__ = ["AttentionShape", "DeltaRuleAttention", "GatedDeltaNetAttention", "KimiDeltaAttention", "LAYER_TYPES",
           "LinearAttentionSpec"]
