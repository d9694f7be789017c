"""The hybrid's transformers classes: ``Retrofit<Base>Config`` and ``Retrofit<Base>ForCausalLM`` (the base causal LM
whose converted ``self_attn`` modules are linear-attention layers), their registration with the Auto classes, and the
hybrid config built from a dense one.

Registration (:func:`register`) is cheap: the config classes come from the base configuration modules, and the model
classes are lazy proxies that import the modeling code only when a model is built.
"""
from __future__ import annotations

from functools import lru_cache

from retrofit.hybrid.section import HybridSection, check_base_type, hybrid_model_type, supported_bases


@lru_cache(maxsize=None)
def config_class(base_type: str):
    """``Retrofit<Base>Config``: the base config class with ``model_type = "retrofit_<base>"``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    check_base_type(base_type)
    base = CONFIG_MAPPING[base_type]
    return type(f"Retrofit{base.__name__}", (base,), {"model_type": hybrid_model_type(base_type),
                                                      "__module__": __name__})


@lru_cache(maxsize=None)
def model_class(base_type: str):
    """``Retrofit<Base>ForCausalLM``: the base causal LM whose converted layers hold linear attention."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    base = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[base_type]]

    def __init__(self, config):
        base.__init__(self, config)
        install_linear_layers(self, HybridSection.from_dict(config.retrofit))

    return type(f"Retrofit{base.__name__}", (base,), {"config_class": config_class(base_type),
                                                      "__init__": __init__, "__module__": __name__})


def _lazy_model_class(base_type: str):
    """A stand-in registered with ``AutoModelForCausalLM`` that imports the real class on first use."""

    def from_pretrained(cls, *args, **kwargs):
        return model_class(base_type).from_pretrained(*args, **kwargs)

    def _from_config(cls, config, **kwargs):
        return model_class(base_type)._from_config(config, **kwargs)

    return type(f"Retrofit{base_type.capitalize()}ForCausalLMLoader", (), {
        "config_class": config_class(base_type), "__module__": __name__,
        "from_pretrained": classmethod(from_pretrained), "_from_config": classmethod(_from_config)})


_registered = False


def register() -> None:
    """Make ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained(hybrid_dir)`` work (idempotent, cheap)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for base in supported_bases():
        if base not in CONFIG_MAPPING:  # a family this transformers release does not have
            continue
        AutoConfig.register(hybrid_model_type(base), config_class(base), exist_ok=True)
        AutoModelForCausalLM.register(config_class(base), _lazy_model_class(base), exist_ok=True)
    _registered = True


def install_linear_layers(model, section: HybridSection) -> None:
    """Put a fresh GDN/KDA layer where the attention module of every layer in ``section.layers`` is (the family's
    architecture record says where and, for a softmax window inside the layer, how the replaced layer scaled,
    softcapped and rotated)."""
    from retrofit import architecture
    from retrofit.layers import LAYER_TYPES, AttentionShape, LinearAttentionSpec

    layer_cls = LAYER_TYPES.get(section.layer_type)
    arch = architecture.for_type(section.base_model_type)
    shape = AttentionShape.from_config(model.config)
    spec = LinearAttentionSpec.from_dict(section.layer_spec)
    facts = arch.layers(architecture.text_config(model.config))
    for i in section.layers:
        param = next(arch.attention_module(model, i).parameters())
        layer = layer_cls(shape, i, spec, attention=facts[i])
        arch.replace_attention(model, i, layer.to(device=param.device, dtype=param.dtype))


def hybrid_config(dense_config, section: HybridSection):
    """The hybrid config: every field of the dense config (``layer_types`` included: the base modeling code picks
    each layer's mask by it), ``model_type`` retrofit_<base> and the ``retrofit`` section."""
    values = dense_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "retrofit"):
        values.pop(key, None)
    return config_class(section.base_model_type)(**values, retrofit=section.to_dict())
