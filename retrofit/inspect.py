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
        f"KV cache         {kv_per_token:,} bytes per token ({kv_per_token * 1024 / 2**20:.2f} MiB per 1K tokens), "
        f"{len(layout.unbounded_layers)} layer(s) whose cache grows with the context",
    ]
    if layout.sliding_layers:
        window_bytes = layout.window_bytes(element_bytes)
        count = len(layout.sliding_layers)
        layers = f"{count} layer{'s' if count != 1 else ''} hold{'s' if count == 1 else ''}"
        lines.append(f"sliding windows  {layers} {window_bytes / 2**20:.2f} MiB per "
                     "sequence at most, whatever the context")
    state = sum(module.state_bytes() for module in layout.attention_modules if hasattr(module, "state_bytes"))
    if state:
        lines.append(f"linear state     {state / 2**20:.2f} MiB per sequence in the converted layers, whatever the "
                     "context")
    lines += ["", "layers  attention"]
    lines += [f"{_span(first, last):>6}  {kind}" for first, last, kind in _runs(_kinds(layout))]
    return "\n".join(lines)


def _kinds(layout) -> list[str]:
    """Per layer: its kind, with the window of a sliding-window layer."""
    return [f"{kind} (window {layout.layers[i].window})" if kind == "sliding_attention" else kind
            for i, kind in enumerate(layout.layer_types)]


def _runs(kinds: list[str]) -> list[tuple[int, int, str]]:
    """Consecutive layers of one kind as (first, last, kind)."""
    runs: list[tuple[int, int, str]] = []
    for index, kind in enumerate(kinds):
        if runs and runs[-1][2] == kind:
            runs[-1] = (runs[-1][0], index, kind)
        else:
            runs.append((index, index, kind))
    return runs


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"
