"""The hybrid checkpoint: config and model classes, conversion of a dense model, save and load.

A hybrid keeps its base architecture (``model_type`` ``retrofit_<base>``, every field of the base config) and adds
a ``retrofit`` section (converted layer indices, layer type, layer hyper-parameters, version) plus ``layer_types``
(``linear_attention`` for converted layers), so that transformers' ``DynamicCache(config=...)`` holds recurrent +
conv states for converted layers and KV for the rest. The model class is the base ``*ForCausalLM`` with the
selected ``self_attn`` modules replaced.

Registration with ``AutoConfig`` / ``AutoModelForCausalLM`` (:func:`register`) is cheap: the config classes come
from the base configuration modules, and the model classes are lazy proxies that import the modeling code only
when a model is built.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from retrofit.errors import RetrofitError

RETROFIT_VERSION = 1
SUPPORTED_BASES = ("llama", "qwen2", "mistral")


@dataclass
class HybridSection:
    """The ``retrofit`` section of a hybrid config.json."""

    layers: list[int]
    layer_type: str
    base_model_type: str
    layer_spec: dict = field(default_factory=dict)
    version: int = RETROFIT_VERSION
    distillation: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"version": self.version, "base_model_type": self.base_model_type, "layer_type": self.layer_type,
                "layers": list(self.layers), "layer_spec": dict(self.layer_spec),
                "distillation": dict(self.distillation)}

    @classmethod
    def from_dict(cls, values: dict) -> "HybridSection":
        if values.get("version", 0) > RETROFIT_VERSION:
            raise RetrofitError(f"hybrid checkpoint version {values['version']} is newer than this retrofit "
                                f"(supports <= {RETROFIT_VERSION}); upgrade retrofit")
        return cls(layers=[int(i) for i in values["layers"]], layer_type=values["layer_type"],
                   base_model_type=values["base_model_type"], layer_spec=dict(values.get("layer_spec", {})),
                   version=values.get("version", RETROFIT_VERSION),
                   distillation=dict(values.get("distillation", {})))


def hybrid_model_type(base_type: str) -> str:
    return f"retrofit_{base_type}"


def check_base_type(base_type: str) -> None:
    """RetrofitError unless a ``base_type`` model (config.model_type) can be converted to a hybrid."""
    if base_type not in SUPPORTED_BASES:
        raise RetrofitError(f"model type {base_type!r} cannot be converted to a hybrid; supported: "
                            f"{', '.join(SUPPORTED_BASES)}")


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

    for base in SUPPORTED_BASES:
        AutoConfig.register(hybrid_model_type(base), config_class(base), exist_ok=True)
        AutoModelForCausalLM.register(config_class(base), _lazy_model_class(base), exist_ok=True)
    _registered = True


def install_linear_layers(model, section: HybridSection) -> None:
    """Replace ``model.model.layers[i].self_attn`` by a fresh GDN/KDA layer for every ``i`` in ``section.layers``."""
    from retrofit.layers import LAYER_TYPES, AttentionShape, LinearAttentionSpec

    layer_cls = LAYER_TYPES.get(section.layer_type)
    shape = AttentionShape.from_config(model.config)
    spec = LinearAttentionSpec.from_dict(section.layer_spec)
    decoder_layers = model.model.layers
    for i in section.layers:
        old = decoder_layers[i].self_attn
        param = next(old.parameters())
        decoder_layers[i].self_attn = layer_cls(shape, i, spec).to(device=param.device, dtype=param.dtype)


def hybrid_config(dense_config, section: HybridSection):
    """The hybrid config: every field of the dense config, ``model_type`` retrofit_<base>, ``retrofit``, ``layer_types``."""
    values = dense_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "retrofit", "layer_types"):
        values.pop(key, None)
    converted = set(section.layers)
    layer_types = ["linear_attention" if i in converted else "full_attention"
                   for i in range(dense_config.num_hidden_layers)]
    return config_class(section.base_model_type)(**values, retrofit=section.to_dict(), layer_types=layer_types)


def to_hybrid(dense_model, section: HybridSection, share_weights: bool = True):
    """A hybrid model whose converted layers are initialised from the dense attention weights
    (:func:`retrofit.convert.init.init_from_attention`) and whose other weights are the dense model's: shared
    (no copy) when ``share_weights``, else cloned (needed when the hybrid's weights will be changed in place, e.g.
    by merging LoRA, while the dense model is still in use). The dense model is left untouched.
    """
    import torch

    from retrofit.convert.init import init_from_attention

    config = hybrid_config(dense_model.config, section)
    config._attn_implementation = dense_model.config._attn_implementation
    param = next(dense_model.parameters())
    with torch.device("meta"):
        hybrid = model_class(section.base_model_type)(config)
    converted = set(section.layers)
    state = {k: (v if share_weights else v.clone()) for k, v in dense_model.state_dict().items()
             if not _in_converted_attention(k, converted)}
    missing, unexpected = hybrid.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"unexpected weights when building the hybrid: {unexpected[:5]}")
    for i in section.layers:
        layer = hybrid.model.layers[i].self_attn
        hybrid.model.layers[i].self_attn = layer = layer.to_empty(device=param.device).to(param.dtype)
        layer.reset_parameters()
        init_from_attention(hybrid.model.layers[i].self_attn, dense_model.model.layers[i].self_attn)
    still_meta = [n for n, p in list(hybrid.named_parameters()) + list(hybrid.named_buffers()) if p.is_meta]
    if still_meta:  # non-persistent buffers (rotary inv_freq) are not in the state dict: take them from the dense model
        dense_buffers = dict(dense_model.named_buffers())
        for name in still_meta:
            module_name, _, attr = name.rpartition(".")
            module = hybrid.get_submodule(module_name)
            if name not in dense_buffers:
                raise RuntimeError(f"hybrid weight {name} has no source in the dense model")
            module._buffers[attr] = dense_buffers[name] if share_weights else dense_buffers[name].clone()
    if getattr(config, "tie_word_embeddings", False):
        hybrid.tie_weights()
    return hybrid.eval() if not dense_model.training else hybrid


def _in_converted_attention(key: str, converted: set[int]) -> bool:
    parts = key.split(".")
    return (len(parts) > 4 and parts[0] == "model" and parts[1] == "layers" and int(parts[2]) in converted
            and parts[3] == "self_attn")


def save_hybrid(model, tokenizer, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write config.json (with the ``retrofit`` section), model.safetensors and the tokenizer to ``out``.

    Files go to a temporary directory beside ``out`` that is renamed into place at the end: an interrupted save
    leaves no half-written checkpoint. An existing ``out`` is only replaced when ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise RetrofitError(f"output directory {out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "previous")
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def load_hybrid(path: str | os.PathLike, dtype=None, device="cpu"):
    """Load a hybrid checkpoint saved by :func:`save_hybrid` -> model in eval mode on ``device``.

    ``dtype``: a torch dtype, a name (``float32``, ``bfloat16``, ...) or None (float32).
    """
    import json

    import torch

    from retrofit.load import parse_dtype

    dtype = parse_dtype(dtype)
    register()
    raw = json.loads((Path(path) / "config.json").read_text())
    section = HybridSection.from_dict(raw["retrofit"])
    check_base_type(section.base_model_type)
    model = model_class(section.base_model_type).from_pretrained(str(path), dtype=dtype or torch.float32)
    return model.to(device).eval()
