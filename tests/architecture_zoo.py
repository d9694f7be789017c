"""Tiny random models of every architecture family retrofit describes, for the contract tests.

Each row builds a model of a few layers with the family's own transformers classes, untied input and output
embeddings, and random values in every bias (a dropped bias changes the tokens). Shapes are small so that a row
generates in well under a second on one CPU thread, and awkward where the family allows it: 4 query heads over 2
key-value heads, head_dim 16. Sliding windows are 64 tokens, far below the prompts of the tests (300 tokens), so that
a window ignored or misplaced changes the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

VOCAB = 49152  # SmolLM2's tokenizer, so that conversions read real calibration text
WINDOW = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, initializer_range=0.1)


@dataclass(frozen=True)
class ZooRow:
    """One row of the contract tests: a name, the family (transformers' ``model_type``) and the config it builds."""

    name: str
    model_type: str
    config: Callable[[], object]


def _config(model_type: str, **overrides):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = {**COMMON, **overrides}
    return CONFIG_MAPPING[model_type](**values)


def _layer_pattern(sliding: int, total: int = 4) -> list[str]:
    """``sliding`` sliding-window layers before each full one, as Gemma 3 and Cohere 2 lay them out."""
    return ["full_attention" if (i + 1) % (sliding + 1) == 0 else "sliding_attention" for i in range(total)]


ROWS: list[ZooRow] = [
    ZooRow("llama", "llama", lambda: _config("llama", attention_bias=True, head_dim=16)),
    ZooRow("mistral", "mistral", lambda: _config("mistral", head_dim=16, sliding_window=None)),
    ZooRow("mistral-window64", "mistral", lambda: _config("mistral", head_dim=16, sliding_window=WINDOW)),
    ZooRow("mixtral", "mixtral", lambda: _config("mixtral", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=None)),
    ZooRow("qwen2", "qwen2", lambda: _config("qwen2")),
    ZooRow("qwen3", "qwen3", lambda: _config("qwen3", head_dim=16)),
    ZooRow("qwen3_moe", "qwen3_moe", lambda: _config("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, decoder_sparse_step=1)),
    ZooRow("gemma", "gemma", lambda: _config("gemma", head_dim=16)),
    ZooRow("gemma2", "gemma2", lambda: _config("gemma2", head_dim=16, sliding_window=WINDOW,
                                               query_pre_attn_scalar=16)),
    ZooRow("gemma2-softcap5", "gemma2", lambda: _config("gemma2", head_dim=16, sliding_window=WINDOW,
                                                        query_pre_attn_scalar=16, attn_logit_softcapping=5.0)),
    ZooRow("gemma2-nosoftcap", "gemma2", lambda: _config("gemma2", head_dim=16, sliding_window=WINDOW,
                                                         query_pre_attn_scalar=16, attn_logit_softcapping=None,
                                                         final_logit_softcapping=None)),
    ZooRow("gemma3", "gemma3_text", lambda: _config("gemma3_text", head_dim=16, sliding_window=WINDOW,
                                                    query_pre_attn_scalar=16, layer_types=_layer_pattern(1))),
    ZooRow("cohere", "cohere", lambda: _config("cohere", use_qk_norm=False, logit_scale=0.5)),
    ZooRow("cohere2", "cohere2", lambda: _config("cohere2", sliding_window=WINDOW, layer_types=_layer_pattern(1),
                                                 logit_scale=0.5)),
    ZooRow("phi3", "phi3", lambda: _config("phi3", sliding_window=None)),
    ZooRow("olmo2", "olmo2", lambda: _config("olmo2")),
    ZooRow("granite", "granite", lambda: _config("granite", attention_multiplier=0.2, embedding_multiplier=2.0,
                                                 residual_multiplier=0.5, logits_scaling=2.0, attention_bias=True)),
    ZooRow("stablelm", "stablelm", lambda: _config("stablelm", partial_rotary_factor=0.25, use_qkv_bias=True)),
    ZooRow("glm", "glm", lambda: _config("glm", head_dim=16, partial_rotary_factor=0.5, attention_bias=True)),
    ZooRow("starcoder2", "starcoder2", lambda: _config("starcoder2", sliding_window=None, use_bias=True)),
    ZooRow("smollm3", "smollm3", lambda: _config("smollm3", no_rope_layer_interval=2)),
    ZooRow("gpt_neox", "gpt_neox", lambda: _config("gpt_neox", rotary_pct=0.25, use_parallel_residual=True)),
    ZooRow("falcon", "falcon", lambda: _config("falcon", new_decoder_architecture=True, num_kv_heads=2,
                                               parallel_attn=True, bias=True)),
    ZooRow("gpt2", "gpt2", lambda: _gpt2()),
]


# A family that is a hybrid already (linear-attention layers of its own): sparse decoding patches its softmax layers
# only, generation runs it, conversion refuses it.
HYBRID_ROWS: list[ZooRow] = [
    ZooRow("qwen3_next", "qwen3_next", lambda: _config(
        "qwen3_next", head_dim=16, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)),
]


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=1024, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      initializer_range=0.1)


BY_NAME = {row.name: row for row in ROWS + HYBRID_ROWS}
FAMILIES = sorted({row.model_type for row in ROWS})


def implementation(config) -> str | None:
    """The attention implementation a row runs: eager for a softcapped Gemma 2, as transformers recommends (its SDPA
    function leaves the cap out; eager is its default from 5.2x on), else transformers' default (None)."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else None


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The row's model with random weights (``seed``), every bias random too, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = BY_NAME[name].config()
    config._attn_implementation = implementation(config)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


def refused_unless_interfaced(model, run) -> bool:
    """Whether ``model``'s family computes attention through transformers' attention interface in this transformers
    release (Falcon does from after 5.17). Where it does not, ``run()`` (a generation or a sparse session, which need
    the interface) must be refused in one line, and this returns False: the caller has nothing else to compare."""
    import pytest

    from retrofit.errors import RetrofitError
    from retrofit.model_info import attention_layout

    if attention_layout(model).interfaced:
        return True
    with pytest.raises(RetrofitError, match="outside transformers' attention interface") as err:
        run()
    assert "\n" not in str(err.value)
    return False
