"""`retrofit inspect`: a plain-text description of a model's attention layout and cache cost."""
from __future__ import annotations

import torch.nn as nn

from retrofit.model_info import attention_layout


def describe(model: nn.Module, name: str = "model", licence: str | None = None) -> str:
    """Layers, attention type per layer, heads, KV heads, head dim, parameters and KV bytes per token (and the
    ``licence`` the weights come under, when given)."""
    layout = attention_layout(model)
    dtype = next(model.parameters()).dtype
    element_bytes = next(model.parameters()).element_size()
    parameters = sum(p.numel() for p in model.parameters())
    kv_per_token = layout.kv_bytes_per_token(element_bytes)
    lines = [
        f"model            {name} ({type(model).__name__}, {model.config.model_type})",
        *([f"licence          {licence}"] if licence else []),
        f"parameters       {parameters:,} ({parameters / 1e6:.1f} M)",
        f"dtype            {str(dtype).removeprefix('torch.')}",
        f"layers           {layout.num_layers} ({len(layout.softmax_layers)} softmax attention)",
        f"heads            {layout.num_heads} query, {layout.num_kv_heads} key-value (GQA group "
        f"{layout.num_heads // layout.num_kv_heads})",
        f"head dim         {layout.head_dim}",
        f"hidden size      {layout.hidden_size}",
        f"max positions    {layout.max_positions}",
        f"KV cache         {kv_per_token:,} bytes per token ({kv_per_token * 1024 / 2**20:.2f} MiB per 1K tokens)",
        "",
        "layer  attention",
    ]
    lines += [f"{index:>5}  {kind}" for index, kind in enumerate(layout.layer_types)]
    return "\n".join(lines)
