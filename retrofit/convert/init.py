"""Initialise a converted layer from the dense attention it replaces (W_q, W_k, W_v, W_o and biases)."""
from __future__ import annotations

import torch
import torch.nn as nn

from retrofit import architecture
from retrofit.architecture import Architecture, Weight


@torch.no_grad()
def init_from_attention(layer: nn.Module, attention: nn.Module, arch: Architecture | None = None,
                        config=None) -> None:
    """Copy the dense attention's q/k/v/o projections (and biases, and q/k norm weights) into a GDN/KDA ``layer``.

    ``arch``: the family's architecture record, which splits fused q/k/v projections (Phi-3, GPT-NeoX, Falcon,
    GPT-2) into separate ``[out, in]`` matrices. With ``expand_kv`` the layer has one key/value head per query head:
    the kv head's rows are repeated for each query head of its group (``[H_kv * D, hidden] -> [H_q * D, hidden]``).
    The layer's other parameters keep their own initialisation (identity conv, slow decay, output gate near 1).
    ``arch`` and ``config`` default to the attention module's own config (transformers' modules keep it) and its
    family's record.
    """
    config = config if config is not None else attention.config
    arch = arch if arch is not None else architecture.of(config)
    parts = arch.projections(attention, config)
    _copy_linear(layer.q_proj, parts.q)
    _copy_linear(layer.o_proj, parts.o)
    groups = layer.num_kv_heads // arch.num_kv_heads(config)
    _copy_linear(layer.k_proj, parts.k, repeat_heads=groups, head_dim=layer.head_dim)
    _copy_linear(layer.v_proj, parts.v, repeat_heads=groups, head_dim=layer.head_dim)
    if layer.shape.qk_norm is not None:
        layer.q_norm.weight.copy_(attention.q_norm.weight)
        k_weight = attention.k_norm.weight
        if layer.shape.qk_norm == "projection" and groups > 1:
            k_weight = k_weight.view(-1, layer.head_dim).repeat_interleave(groups, 0).reshape(-1)
        layer.k_norm.weight.copy_(k_weight)


def _copy_linear(target: nn.Linear, source: Weight, repeat_heads: int = 1, head_dim: int = 0) -> None:
    weight, bias = source.weight, source.bias
    if repeat_heads > 1:
        weight = weight.reshape(-1, head_dim, weight.shape[-1]).repeat_interleave(repeat_heads, 0).reshape(
            -1, weight.shape[-1])
        bias = None if bias is None else bias.reshape(-1, head_dim).repeat_interleave(repeat_heads, 0).reshape(-1)
    if target.weight.shape != weight.shape:
        raise ValueError(f"cannot initialise a {tuple(target.weight.shape)} projection from {tuple(weight.shape)}")
    target.weight.copy_(weight)
    if target.bias is not None:
        if bias is None:
            target.bias.zero_()
        else:
            target.bias.copy_(bias)
    elif bias is not None:
        raise ValueError("the dense projection has a bias the converted layer has no place for")


@torch.no_grad()
def match_output_scale(layers: dict[int, nn.Module], dense: nn.Module, input_ids: torch.Tensor) -> dict[int, float]:
    """Set each converted layer's output-norm weight ``[H, D]`` to the per-channel RMS of its dense attention's
    output before W_o (divided by the initial output gate), measured on ``input_ids`` ``[B, T]``.

    The kernel output is RMS-normalised per head, so with unit norm weights the layer starts several times too loud
    or too quiet; this makes its initial output the right size, channel by channel. Returns layer -> the RMS ratio
    applied (mean over channels), for logging.
    """
    records: dict[int, torch.Tensor] = {}
    handles = []
    arch = architecture.of(dense)
    for i in layers:
        o_proj = arch.output_projection(arch.attention_module(dense, i))

        def hook(module, args, i=i):
            records[i] = args[0].detach()

        handles.append(o_proj.register_forward_pre_hook(hook))
    try:
        dense(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    applied = {}
    for i, layer in layers.items():
        heads, dim = layer.o_norm.weight.shape
        pre = records[i].float().reshape(-1, heads, dim)
        rms = pre.pow(2).mean(0).sqrt()  # [H, D]
        gate = torch.sigmoid(_output_gate_bias(layer)).float()
        layer.o_norm.weight.copy_((rms / gate).to(layer.o_norm.weight.dtype))
        applied[i] = float(rms.mean())
    return applied


def _output_gate_bias(layer: nn.Module) -> torch.Tensor:
    """Initial output gate logit(s) of a GDN (g_proj) or KDA (g_b_proj) layer, broadcastable to ``[H, D]``."""
    proj = getattr(layer, "g_proj", None) or getattr(layer, "g_b_proj")
    return proj.bias.detach().view(layer.o_norm.weight.shape)
