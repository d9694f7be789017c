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


@torch.no_grad()
def calibrate_far_logits(layers: dict[int, nn.Module], dense: nn.Module, input_ids: torch.Tensor) -> dict[int, float]:
    """Start each windowed converted layer's far-logit estimate ``c(x)`` (``far_logit_proj``: weight 0, a bias per
    query head) at what the dense attention shows on ``input_ids [B, T]``: the mean over positions with far keys of
    ``log Z_far - log n_far``, the log of the far keys' summed ``exp(logit)`` over their count
    (``retrofit.layers.window``). The layer's q and k are the dense attention's at this point (copied), so the
    window's share of each query's output starts at the share of attention mass the dense model gives the window.
    Layers without a window are left alone. Returns layer -> the mean bias set, for logging."""
    from retrofit.convert.objectives import AttentionCapture
    from retrofit.layers.window import far_counts, window_attention_reference

    windowed = {i: layer for i, layer in layers.items() if getattr(layer, "window", 0)}
    if not windowed:
        return {}
    capture = AttentionCapture(dense, sorted(windowed))
    try:
        records = capture.run(dense, input_ids)
    finally:
        capture.remove()
    applied = {}
    with torch.autocast(device_type=input_ids.device.type, enabled=False):
        for i, layer in windowed.items():
            record = records[i]
            dtype = layer.q_proj.weight.dtype
            x = record["hidden_states"].to(dtype)
            rotary = record["position_embeddings"]
            rotary = None if rotary is None else tuple(part.to(dtype) for part in rotary)
            projected = layer._normed(layer.q_proj(x), layer.k_proj(x)) + [layer.v_proj(x)]
            q, k, v = layer.window_qkv(projected, rotary)
            B, T = x.shape[:2]
            far = far_counts(torch.arange(T, device=x.device), layer.window, layer.sink_tokens)  # [T]
            if not bool((far > 0).any()):
                continue  # windows too short to have far keys: nothing to measure
            sums, count = torch.zeros(layer.num_heads, device=x.device), 0
            for row in range(B):  # one row at a time: [T, T] logits per head
                args = (q[row:row + 1], k[row:row + 1], v[row:row + 1], None)
                _, total = window_attention_reference(*args, T, 0, layer.window_scale, layer.window_softcap)
                _, near = window_attention_reference(*args, layer.window, layer.sink_tokens, layer.window_scale,
                                                     layer.window_softcap)
                far_share = (-torch.expm1(near - total)).clamp_min(1e-12)  # 1 - Z_near / Z_total
                log_far_mass = total + torch.log(far_share)  # [1, T, Hq]
                per_key = (log_far_mass[0] - torch.log(far.clamp_min(1).float())[:, None])[far > 0]
                sums += per_key.sum(0)
                count += per_key.shape[0]
            bias = sums / count
            layer.far_logit_proj.weight.zero_()
            layer.far_logit_proj.bias.copy_(bias.to(layer.far_logit_proj.bias.dtype))
            applied[i] = float(bias.mean())
    return applied
