"""The hybrid checkpoint: a dense model's architecture with some attention layers replaced by linear attention.

A hybrid keeps its base architecture (``model_type`` ``retrofit_<base>``, every field of the base config) and adds
a ``retrofit`` section (converted layer indices, layer type, layer hyper-parameters, version). ``layer_types`` stays
the base family's (full or sliding per layer): the base modeling code picks each layer's mask by it, and a converted
layer reads only padding from its mask. A converted layer keeps its conv and recurrent states in a linear-attention
layer of the cache (``retrofit.layers.state``). The model class is the base ``*ForCausalLM`` with the converted
layers' attention modules replaced (where the family's architecture record says they are).

``section.py`` (the config section), ``classes.py`` (config and model classes, Auto registration),
``checkpoint.py`` (save, load). Loading needs none of the conversion code (``retrofit.convert`` builds and trains
hybrids).
"""
from retrofit.hybrid.checkpoint import load_hybrid, save_hybrid
from retrofit.hybrid.classes import config_class, hybrid_config, install_linear_layers, model_class, register
from retrofit.hybrid.section import (RETROFIT_VERSION, HybridSection, check_base_type, conversion_refusal,
                                     hybrid_model_type, supported_bases)

__all__ = ["HybridSection", "RETROFIT_VERSION", "check_base_type", "config_class", "conversion_refusal",
           "hybrid_config", "hybrid_model_type", "install_linear_layers", "load_hybrid", "model_class", "register",
           "save_hybrid", "supported_bases"]
