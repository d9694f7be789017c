"""The architecture records, one per transformers ``model_type`` (each read off that family's
``models/<family>/modeling_<family>.py`` in transformers 5.x). A family missing here is refused in one line before
its weights load; adding one is a record here plus a row in the contract tests' zoo (``tests/architecture_zoo.py``).
"""
from __future__ import annotations

from retrofit.architecture.layouts import PerGroup, PerHead, Stacked
from retrofit.architecture.record import Architecture, QKNorm, inverse_sqrt
from retrofit.registry import Registry

ARCHITECTURES: Registry = Registry("architecture")


def _add(record: Architecture) -> Architecture:
    return ARCHITECTURES.register(record.model_type)(record)


def _both(flag: str, default: bool = False):
    """Biases on q, k, v and on o alike, as the config's ``flag`` says."""
    return lambda config: (bool(getattr(config, flag, default)),) * 2


def _qkv_only(flag: str, default: bool = False):
    """Biases on q, k, v (as ``flag`` says) and none on o."""
    return lambda config: (bool(getattr(config, flag, default)), False)


def _none(config):
    return (False, False)


def _query_pre_attn_scalar(config, index):
    return inverse_sqrt(config.query_pre_attn_scalar)


def _gemma_final_softcap(config):
    return getattr(config, "final_logit_softcapping", None)


LLAMA_LIKE = dict(decode_fusion=True)

_add(Architecture("llama", biases=_both("attention_bias"), **LLAMA_LIKE))
_add(Architecture("mistral", biases=_none, **LLAMA_LIKE))
_add(Architecture("mixtral", biases=_none, mlp_projections=(), experts=True, notes="experts left untouched"))
_add(Architecture("qwen2", biases=lambda config: (True, False), **LLAMA_LIKE))
_add(Architecture("qwen3", biases=_both("attention_bias"), qk_norm=QKNorm("head")))
_add(Architecture("qwen3_moe", biases=_both("attention_bias"), qk_norm=QKNorm("head"), mlp_projections=(),
                  experts=True, notes="experts left untouched"))
_add(Architecture("gemma", biases=_both("attention_bias"), norm="rms_unit_offset"))
_add(Architecture("gemma2", biases=_both("attention_bias"), norm="rms_unit_offset", scaling=_query_pre_attn_scalar,
                  softcap=lambda config: getattr(config, "attn_logit_softcapping", None),
                  final_logit_softcap=_gemma_final_softcap))
_add(Architecture("gemma3_text", biases=_both("attention_bias"), norm="rms_unit_offset",
                  qk_norm=QKNorm("head", unit_offset=True), scaling=_query_pre_attn_scalar,
                  final_logit_softcap=_gemma_final_softcap))
_add(Architecture("cohere", biases=_both("attention_bias"), norm="layer", rotary_interleaved=True,
                  parallel_block=lambda config: True, logit_multiplier=lambda config: config.logit_scale,
                  conversion_refused_with=("use_qk_norm", "cohere's q/k LayerNorm is not carried into converted "
                                                          "layers")))
_add(Architecture("cohere2", biases=_both("attention_bias"), norm="layer", rotary_interleaved=True,
                  parallel_block=lambda config: True, logit_multiplier=lambda config: config.logit_scale,
                  rotates=lambda config, index, kind: kind == "sliding_attention"))
_add(Architecture("phi3", biases=_none, qkv=Stacked("qkv_proj"), mlp_projections=("gate_up_proj", "down_proj")))
_add(Architecture("olmo2", biases=_both("attention_bias"), qk_norm=QKNorm("projection")))
_add(Architecture("granite", biases=_both("attention_bias"), scaling=lambda config, index: config.attention_multiplier,
                  logit_multiplier=lambda config: 1.0 / config.logits_scaling))
_add(Architecture("stablelm", biases=_qkv_only("use_qkv_bias"), norm="layer",
                  parallel_block=lambda config: bool(config.use_parallel_residual),
                  conversion_refused_with=("qk_layernorm", "stablelm's per-head q/k LayerNorm is not carried into "
                                                           "converted layers")))
_add(Architecture("glm", biases=_qkv_only("attention_bias"), rotary_interleaved=True,
                  mlp_projections=("gate_up_proj", "down_proj")))
_add(Architecture("starcoder2", biases=_both("use_bias", True), norm="layer", mlp_projections=("c_fc", "c_proj")))
_add(Architecture("smollm3", biases=_both("attention_bias"),
                  rotates=lambda config, index, kind: bool(config.no_rope_layers[index])))
_add(Architecture("gpt_neox", decoder="gpt_neox.layers", attention="attention", final_norm="gpt_neox.final_layer_norm",
                  lm_head="lm_head|embed_out", qkv=PerHead("query_key_value"), output="dense",
                  biases=_both("attention_bias"),
                  kv_heads=lambda config: config.num_attention_heads, norm="layer",
                  parallel_block=lambda config: bool(config.use_parallel_residual),
                  mlp_projections=("dense_h_to_4h", "dense_4h_to_h")))
_add(Architecture("falcon", decoder="transformer.h", attention="self_attention", final_norm="transformer.ln_f",
                  qkv=lambda config: (PerGroup("query_key_value") if config.new_decoder_architecture
                                      else Stacked("query_key_value") if config.multi_query
                                      else PerHead("query_key_value")),
                  output="dense", biases=_both("bias"), kv_heads=lambda config: config.num_key_value_heads,
                  rotary_fraction=lambda config: 0.0 if config.alibi else 1.0, norm="layer",
                  parallel_block=lambda config: bool(config.parallel_attn or config.new_decoder_architecture),
                  mlp_projections=("dense_h_to_4h", "dense_4h_to_h")))
_add(Architecture("gpt2", decoder="transformer.h", attention="attn", final_norm="transformer.ln_f",
                  qkv=Stacked("c_attn"), output="c_proj", biases=lambda config: (True, True),
                  kv_heads=lambda config: config.num_attention_heads, rotary_fraction=lambda config: 0.0,
                  scaling=lambda config, index: ((config.head_dim if hasattr(config, "head_dim") else
                                                  config.hidden_size // config.num_attention_heads) ** -0.5
                                                 if config.scale_attn_weights else 1.0)
                  / ((index + 1) if config.scale_attn_by_inverse_layer_idx else 1),
                  norm="layer", mlp_projections=("c_fc", "c_proj")))
_add(Architecture("qwen3_next", biases=_both("attention_bias"), qk_norm=QKNorm("head", unit_offset=True),
                  mlp_projections=(), experts=True, already_hybrid=True,
                  notes="linear-attention layers native; sparse decoding applies to its softmax layers"))
