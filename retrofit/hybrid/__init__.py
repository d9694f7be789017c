"""The hybrid checkpoint: a dense model's architecture with some attention layers replaced by linear attention.

A hybrid keeps its base architecture (``model_type`` ``retrofit_<base>``, every field of the base config) and adds
a ``retrofit`` section (converted layer indices, layer type, layer hyper-parameters, version) plus ``layer_types``
(``linear_attention`` for converted layers), so that transformers' ``DynamicCache(config=...)`` holds recurrent +
conv states for converted layers and KV for the rest. The model class is the base ``*ForCausalLM`` with the
selected ``self_attn`` modules replaced.

``section.py`` (the config section), ``classes.py`` (config and model classes, Auto registration),
``checkpoint.py`` (save, load). Loading needs none of the conversion code (``retrofit.convert`` builds and trains
hybrids).
"""
from retrofit.hybrid.checkpoint import load_hybrid, save_hybrid
from retrofit.hybrid.classes import config_class, hybrid_config, install_linear_layers, model_class, register
from retrofit.hybrid.section import (RETROFIT_VERSION, SUPPORTED_BASES, HybridSection, check_base_type,
                                     hybrid_model_type)

__all__ = ["HybridSection", "RETROFIT_VERSION", "SUPPORTED_BASES", "check_base_type", "config_class", "hybrid_config",
           "hybrid_model_type", "install_linear_layers", "load_hybrid", "model_class", "register", "save_hybrid"]
