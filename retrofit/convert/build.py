"""Building a hybrid from a dense model: the converted layers initialised from its attention, the rest shared or copied."""
from __future__ import annotations

from retrofit.hybrid import HybridSection, hybrid_config, model_class


def to_hybrid(dense_model, section: HybridSection, share_weights: bool = True, layer_dtype=None):
    """A hybrid model whose converted layers are initialised from the dense attention weights
    (:func:`retrofit.convert.init.init_from_attention`) and whose other weights are the dense model's: shared
    (no copy) when ``share_weights``, else cloned (needed when the hybrid's weights will be changed in place, e.g.
    by merging LoRA, while the dense model is still in use). The dense model is left untouched.

    Shared weights are the dense model's tensors (the same storage) under the hybrid's own ``Parameter`` objects and
    modules, so the hybrid's ``requires_grad`` flags and module replacements (peft) never reach the dense model.
    ``layer_dtype``: dtype of the converted layers (default: the dense model's), e.g. float32 layers to train beside
    frozen bfloat16 weights.
    """
    import torch

    from retrofit import architecture
    from retrofit.convert.init import init_from_attention

    arch = architecture.of(dense_model)
    config = hybrid_config(dense_model.config, section)
    config._attn_implementation = dense_model.config._attn_implementation
    param = next(dense_model.parameters())
    with torch.device("meta"):
        hybrid = model_class(section.base_model_type)(config)
    converted = set(section.layers)
    prefixes = tuple(arch.attention_prefix(i) for i in converted)
    state = {k: (v if share_weights else v.clone()) for k, v in dense_model.state_dict().items()
             if not k.startswith(prefixes)}
    missing, unexpected = hybrid.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"unexpected weights when building the hybrid: {unexpected[:5]}")
    for i in section.layers:
        layer = arch.attention_module(hybrid, i).to_empty(device=param.device).to(layer_dtype or param.dtype)
        arch.replace_attention(hybrid, i, layer)
        layer.reset_parameters()
        init_from_attention(layer, arch.attention_module(dense_model, i), arch, architecture.text_config(dense_model))
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

