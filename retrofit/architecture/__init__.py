"""One description of each model family's attention (``record.py``, ``families.py``), read by generation, sparse
decoding and conversion:

    arch = retrofit.architecture.of(model)            # the family's record; RetrofitError if none
    arch.layers(model.config)                         # per layer: kind, window, softcap, scaling, rotary dims
    arch.attention_module(model, 3)                   # layer 3's attention module

A hybrid saved by ``retrofit convert`` (``model_type`` ``retrofit_<base>``) is described by its base family's record.
"""
from __future__ import annotations

from retrofit.architecture.families import ARCHITECTURES
from retrofit.architecture.layouts import PerGroup, PerHead, QKVLayout, Separate, Stacked, linear_weight
from retrofit.architecture.record import Architecture, LayerAttention, Projections, QKNorm, Weight
from retrofit.errors import RetrofitError

HYBRID_PREFIX = "retrofit_"


def base_model_type(config) -> str:
    """The family a config belongs to: its ``model_type``, a hybrid's base type, a multimodal wrapper's text model."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    section = getattr(config, "retrofit", None)
    if isinstance(section, dict) and section.get("base_model_type"):
        return str(section["base_model_type"])
    return model_type[len(HYBRID_PREFIX):] if model_type.startswith(HYBRID_PREFIX) else model_type


def describes(model_type: str) -> bool:
    return model_type in ARCHITECTURES


def for_type(model_type: str) -> Architecture:
    """The record of ``model_type``, or a one-line RetrofitError naming the families retrofit describes."""
    if model_type not in ARCHITECTURES:
        raise RetrofitError(f"model type {model_type!r} has no architecture record in retrofit, so its attention "
                            f"cannot be read safely; described: {', '.join(ARCHITECTURES.names())}")
    return ARCHITECTURES.get(model_type)


def of(model_or_config) -> Architecture:
    """The record of a model's (or config's) family; RetrofitError (one line) if retrofit has none."""
    config = getattr(model_or_config, "config", model_or_config)
    return for_type(base_model_type(config))


def text_config(model_or_config):
    """The decoder's config (a multimodal wrapper's text config, else the config itself)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


__all__ = ["ARCHITECTURES", "Architecture", "HYBRID_PREFIX", "LayerAttention", "PerGroup", "PerHead", "Projections",
           "QKNorm", "QKVLayout", "Separate", "Stacked", "Weight", "base_model_type", "describes", "for_type",
           "linear_weight", "of", "text_config"]
