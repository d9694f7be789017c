"""Running a model's softmax attention through a function of ours, for the length of a ``with`` block only.

transformers dispatches attention through ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` and builds masks
through ``ALL_MASK_ATTENTION_FUNCTIONS`` under the same name. :func:`attention_function` registers a function under a
private name (with the mask function of the model's own implementation, so masks are built exactly as before),
points every attention config of the model at it, and undoes all of it on exit, exceptions included. Sparse decoding
(``retrofit.sparse``), Seer gate training and the retrieval probe of scored layer selection
(``retrofit.convert.retrieval_probe``) use it; nothing is patched at import time.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


def softmax_attention_layers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer index -> attention module, for the layers whose softmax attention reads a cache that grows with the
    context, as the model's architecture record says (:mod:`retrofit.architecture`): sliding-window layers (bounded
    already), converted and native linear-attention layers are left out. A family without a record is a
    RetrofitError (one line)."""
    from retrofit.model_info import attention_layout

    layout = attention_layout(model)
    return {index: layout.attention_modules[index] for index in layout.unbounded_layers}


def implementation_of(model: torch.nn.Module) -> str:
    """The attention implementation the model runs now (``eager``, ``sdpa``, ...)."""
    return model.config._attn_implementation or "eager"


def dense_attention(implementation: str, module, query, key, value, attention_mask, **kwargs):
    """Run attention implementation ``implementation`` (as transformers would) for ``module``; ``eager`` is the
    modeling file's own ``eager_attention_forward``. A call that asks for logit softcapping (``softcap``, Gemma 2)
    runs the eager function whatever the implementation: transformers' SDPA and flash functions leave the cap out
    without a word, and retrofit computes the model as its family defines it."""
    if kwargs.get("softcap"):
        implementation = "eager"
    if implementation == "eager":
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    else:
        function = ALL_ATTENTION_FUNCTIONS[implementation]
    return function(module, query, key, value, attention_mask, **kwargs)


def _attention_configs(model: torch.nn.Module) -> list[Any]:
    configs, stack = [], [model.config]
    while stack:
        config = stack.pop()
        if any(config is seen for seen in configs):
            continue
        configs.append(config)
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                stack.append(sub)
    return configs


def mask_function_of(model: torch.nn.Module) -> Callable:
    """The function transformers builds the model's attention masks with now (its implementation's)."""
    return ALL_MASK_ATTENTION_FUNCTIONS[implementation_of(model)]


@contextmanager
def attention_function(model: torch.nn.Module, function: Callable, tag: str,
                       mask_function: Callable | None = None) -> Iterator[str]:
    """Inside the block, every softmax-attention call of ``model`` goes to ``function(module, query, key, value,
    attention_mask, **kwargs)`` (transformers' attention interface) and masks are built by ``mask_function``
    (transformers' mask interface; default: the model's own, so masks are exactly as before); yields the private
    name both are registered under (``retrofit_<tag>_<id>``)."""
    from retrofit.model_info import attention_layout

    attention_layout(model).require_interface(f"retrofit's attention function ({tag})")
    name = f"retrofit_{tag}_{id(function):x}"
    saved = [(config, config.__dict__.get("_attn_implementation_internal")) for config in _attention_configs(model)]
    ALL_ATTENTION_FUNCTIONS._global_mapping[name] = function
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name] = mask_function or mask_function_of(model)
    try:
        for config, _ in saved:
            config.__dict__["_attn_implementation_internal"] = name
        yield name
    finally:
        for config, value in saved:
            config.__dict__["_attn_implementation_internal"] = value
        ALL_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
