"""What one model family's attention looks like: the record generation, sparse decoding and conversion read.

A record (:class:`Architecture`) is written once per transformers ``model_type`` (``families.py``) from that
family's modeling file, the source of truth. It says where the decoder blocks and their attention modules are, how
q, k and v come out of the projections (separate, or one fused matrix in a stated layout), which biases and q/k norms
there are, how rotary embedding applies (fraction of the head, interleaved pairs, layers without it), the scaling,
logit softcapping and sliding window of every layer, and what the causal-LM head does to the logits (final
softcapping, multipliers). Everything per layer comes out of :meth:`Architecture.layers` as :class:`LayerAttention`.

The contract tests check every record against what transformers really does with a tiny random model of the family:
the window, softcap and scaling each attention call receives, the biases of the modules, and q, k, v as the attention
function receives them equal the record's split of the projection weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from retrofit.architecture.layouts import QKVLayout, Separate, Weight, linear_weight

Config = Any
ConfigRule = Callable[[Config], Any]


@dataclass(frozen=True)
class LayerAttention:
    """One decoder layer's attention as the model computes it.

    ``kind``: ``full_attention`` / ``sliding_attention`` (softmax), or ``linear_attention`` (a recurrent layer the
    family has natively, e.g. Qwen3-Next's). ``window``: keys a query sees, itself included (transformers' sliding
    mask keeps ``q - window < k <= q``), None if unbounded. ``softcap``: the attention logits go through
    ``softcap * tanh(logits / softcap)`` before the softmax (None: not). ``scaling``: the factor on ``q . k``.
    ``rotary_dims``: channels of each head rotated (0: the layer has no positional rotation, NoPE).
    """

    index: int
    kind: str
    window: int | None
    softcap: float | None
    scaling: float
    rotary_dims: int

    @property
    def softmax(self) -> bool:
        return self.kind != "linear_attention"

    @property
    def bounded(self) -> bool:
        """Whether the layer's key-value cache is bounded by its window (sliding) rather than growing with context."""
        return self.window is not None


@dataclass(frozen=True)
class QKNorm:
    """Normalisation of q and k after the projections (before rotation): RMSNorm over each head's channels
    (``per="head"``, Qwen3, Gemma 3) or over the whole projection (``per="projection"``, OLMo 2), with the weight
    applied as ``w`` or, for Gemma, ``1 + w`` (``unit_offset``). The modules are ``q_norm`` / ``k_norm`` of the
    attention module."""

    per: str
    unit_offset: bool = False
    eps: ConfigRule = field(default=lambda config: getattr(config, "rms_norm_eps", 1e-6))


@dataclass(frozen=True)
class Architecture:
    """The attention of one model family (see the module docstring). Paths are attribute paths from the causal LM
    (``decoder``, ``final_norm``, ``lm_head``) or from a decoder block (``attention``, ``mlp``). ``experts``: the MLP
    is a mixture of experts, whose routing transformers runs with host-side bookkeeping (a decode step of it cannot
    be captured as a CUDA graph)."""

    model_type: str
    decoder: str = "model.layers"
    attention: str = "self_attn"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    qkv: QKVLayout | Callable[[Config], QKVLayout] = Separate()
    output: str = "o_proj"
    biases: ConfigRule = lambda config: (bool(getattr(config, "attention_bias", False)),) * 2
    qk_norm: QKNorm | ConfigRule | None = None
    rotary_fraction: ConfigRule = lambda config: _partial_rotary_factor(config)
    rotary_interleaved: bool = False
    rotates: Callable[[Config, int, str], bool] = lambda config, index, kind: True
    scaling: Callable[[Config, int], float | None] = lambda config, index: None
    softcap: ConfigRule = lambda config: None
    final_logit_softcap: ConfigRule = lambda config: None
    logit_multiplier: ConfigRule = lambda config: 1.0
    kv_heads: ConfigRule | None = None
    mlp: str = "mlp"
    mlp_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    norm: str = "rms"
    parallel_block: ConfigRule = lambda config: False
    decode_fusion: bool = False
    experts: bool = False
    conversion_refused_with: tuple[str, str] | None = None
    already_hybrid: bool = False
    notes: str = ""

    # -- shapes ----------------------------------------------------------------------------------------------------
    def num_heads(self, config) -> int:
        return int(config.num_attention_heads)

    def num_kv_heads(self, config) -> int:
        if self.kv_heads is not None:
            return int(self.kv_heads(config))
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def head_dim(self, config) -> int:
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def qk_norm_of(self, config) -> QKNorm | None:
        """The q/k norm of this config (a family may have it optionally, e.g. by a config flag)."""
        if self.qk_norm is None or isinstance(self.qk_norm, QKNorm):
            return self.qk_norm
        return self.qk_norm(config)

    # -- per layer -------------------------------------------------------------------------------------------------
    def layer_kinds(self, config) -> list[str]:
        """``full_attention`` / ``sliding_attention`` / ``linear_attention`` per layer, as transformers decides them:
        the config's ``layer_types`` where it has them, else every layer sliding where the config sets a
        ``sliding_window`` (Mistral, Mixtral, Phi-3, Starcoder2), else every layer full."""
        count = int(config.num_hidden_layers)
        declared = getattr(config, "layer_types", None)
        if declared:
            return [str(kind) for kind in declared][:count]
        if getattr(config, "sliding_window", None) is not None:
            return ["sliding_attention"] * count
        return ["full_attention"] * count

    def layers(self, config) -> list[LayerAttention]:
        """Every decoder layer's :class:`LayerAttention`."""
        head_dim = self.head_dim(config)
        softcap = self.softcap(config)
        window = getattr(config, "sliding_window", None)
        rotated = int(head_dim * float(self.rotary_fraction(config)))
        out = []
        for index, kind in enumerate(self.layer_kinds(config)):
            scaling = self.scaling(config, index)
            scaling = head_dim ** -0.5 if scaling is None else float(scaling)
            out.append(LayerAttention(
                index=index, kind=kind, window=int(window) if kind == "sliding_attention" else None,
                softcap=None if softcap is None else float(softcap), scaling=scaling,
                rotary_dims=rotated if self.rotates(config, index, kind) else 0))
        return out

    # -- modules of a model ----------------------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The decoder blocks of ``model`` (a causal LM of this family)."""
        return _resolve(model, self.decoder)

    def attention_of(self, block: nn.Module) -> nn.Module:
        return getattr(block, self.attention)

    def attention_module(self, model: nn.Module, index: int) -> nn.Module:
        """Layer ``index``'s attention module (softmax, or the linear layer a conversion put there)."""
        return self.attention_of(self.blocks(model)[index])

    def replace_attention(self, model: nn.Module, index: int, module: nn.Module) -> nn.Module:
        """Put ``module`` where layer ``index``'s attention module is; returns the module it replaced."""
        block = self.blocks(model)[index]
        previous = getattr(block, self.attention)
        setattr(block, self.attention, module)
        return previous

    def attention_prefix(self, index: int) -> str:
        """State-dict key prefix of layer ``index``'s attention module (``model.layers.3.self_attn.``)."""
        return f"{self.decoder}.{index}.{self.attention}."

    def block_prefix(self, index: int) -> str:
        return f"{self.decoder}.{index}."

    def output_projection(self, attention: nn.Module) -> nn.Module:
        """The module applying W_o to the attention's per-head outputs."""
        return getattr(attention, self.output)

    def final_norm_of(self, model: nn.Module) -> nn.Module:
        return _resolve(model, self.final_norm)

    def lm_head_of(self, model: nn.Module) -> nn.Module:
        return _resolve(model, self.lm_head)

    def logits(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[..., hidden]`` (the final norm's output) -> logits ``[..., vocab]`` as the causal LM computes
        them: the LM head, then the family's multiplier and final softcapping."""
        logits = self.lm_head_of(model)(hidden)
        return self.logits_from_head(model.config, logits)

    def logits_from_head(self, config, logits: torch.Tensor) -> torch.Tensor:
        """The family's transformation of the LM head's output (identity for most)."""
        multiplier = float(self.logit_multiplier(config))
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = self.final_logit_softcap(config)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def qkv_layout(self, config) -> QKVLayout:
        """Where q, k and v are among the attention's projections, for this config."""
        return self.qkv if isinstance(self.qkv, QKVLayout) else self.qkv(config)

    def projections(self, attention: nn.Module, config) -> "Projections":
        """q, k, v and o of a softmax attention module as separate ``[out, in]`` weights and biases (views of the
        module's parameters where the layout allows; fused layouts are split)."""
        q, k, v = self.qkv_layout(config).split(attention, self.num_heads(config), self.num_kv_heads(config),
                                                self.head_dim(config))
        return Projections(q=q, k=k, v=v, o=linear_weight(self.output_projection(attention)))

    def attention_projection_names(self, config) -> tuple[str, ...]:
        """Names, inside the attention module, of the projections (LoRA targets of layers kept softmax)."""
        return (*self.qkv_layout(config).names, self.output)

    def conversion_refusal(self, config) -> str | None:
        """Why this config cannot be converted to a hybrid (one line), or None."""
        if self.already_hybrid:
            return f"{self.model_type} is already a hybrid of linear and softmax attention"
        if self.conversion_refused_with is not None:
            flag, reason = self.conversion_refused_with
            if getattr(config, flag, False):
                return f"{reason} ({flag} is set)"
        return None


@dataclass(frozen=True)
class Projections:
    q: Weight
    k: Weight
    v: Weight
    o: Weight


def _resolve(root: nn.Module, path: str):
    """The attribute at dotted ``path`` under ``root``; ``a|b`` tries ``a`` first (names that changed between
    transformers releases)."""
    alternatives = path.split("|")
    for number, alternative in enumerate(alternatives):
        target = root
        try:
            for part in alternative.split("."):
                target = getattr(target, part)
        except AttributeError:
            if number == len(alternatives) - 1:
                raise
            continue
        return target
    raise AttributeError(path)


def _partial_rotary_factor(config) -> float:
    """The fraction of each head that rotary embedding rotates: ``partial_rotary_factor`` (top level or in
    ``rope_parameters``, transformers 5.x), ``rotary_pct`` (GPT-NeoX), else 1."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and parameters.get("partial_rotary_factor") is not None:
        return float(parameters["partial_rotary_factor"])
    for name in ("partial_rotary_factor", "rotary_pct"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    return 1.0


def inverse_sqrt(value: float | None) -> float | None:
    return None if value is None else 1.0 / math.sqrt(float(value))
