"""Initialise a converted layer from the dense attention it replaces (W_q, W_k, W_v, W_o and biases)."""
from __future__ import annotations

import torch
import torch.nn as nn


@torch.no_grad()
def init_from_attention(layer: nn.Module, attention: nn.Module) -> None:
    """Copy the dense attention's q/k/v/o projections into a GDN/KDA ``layer``.

    With ``expand_kv`` the layer has one key/value head per query head: the kv head's rows are repeated for each
    query head of its group (``[H_kv * D, hidden] -> [H_q * D, hidden]``). The layer's other parameters keep their
    own initialisation (identity conv, slow decay, output gate near 1).
    """
    copies = [("q_proj", attention.q_proj), ("o_proj", attention.o_proj)]
    for name, source in copies:
        _copy_linear(getattr(layer, name), source)
    groups = layer.num_kv_heads // _kv_heads(attention, layer)
    for name in ("k_proj", "v_proj"):
        _copy_linear(getattr(layer, name), getattr(attention, name), repeat_heads=groups, head_dim=layer.head_dim)


def _kv_heads(attention: nn.Module, layer: nn.Module) -> int:
    return attention.k_proj.weight.shape[0] // layer.head_dim


def _copy_linear(target: nn.Linear, source: nn.Linear, repeat_heads: int = 1, head_dim: int = 0) -> None:
    weight, bias = source.weight, source.bias
    if repeat_heads > 1:
        weight = weight.view(-1, head_dim, weight.shape[-1]).repeat_interleave(repeat_heads, 0).reshape(-1, weight.shape[-1])
        bias = None if bias is None else bias.view(-1, head_dim).repeat_interleave(repeat_heads, 0).reshape(-1)
    if target.weight.shape != weight.shape:
        raise ValueError(f"cannot initialise a {tuple(target.weight.shape)} projection from {tuple(weight.shape)}")
    target.weight.copy_(weight)
    if target.bias is not None:
        if bias is None:
            target.bias.zero_()
        else:
            target.bias.copy_(bias)
