"""How long a long-context task would run on the CPU, so that a run of hours is refused before it starts.

A causal forward over ``T`` tokens costs about ``2 * W * T`` floating-point operations for the ``W`` weights of the
decoder layers, ``2 * T**2 * H * D`` for the scores and the weighted values of each softmax layer (``H`` query heads
of ``D`` dims, over the causal triangle), and ``2 * V * hidden`` for each position whose logits are computed (one per
prefill chunk and per new token in generation). The CPU's rate is timed once per model on a short forward, so the
estimate follows this machine and its load. Sliding-window layers are counted as full ones (an overestimate for
them). Measured on 2 busy cores (2026-12-06), passkey items of Qwen2.5-0.5B in float32: 100 s at 4K and 361 s at 8K
tokens, where this predicted 154 s and 370 s; at 32K it predicted 49 to 98 minutes an item as the load of the
machine varied.
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.nn as nn

from retrofit.errors import RetrofitError
from retrofit.model_info import attention_layout, model_device

# A run estimated above this many seconds on the CPU is refused.
CPU_SECONDS_LIMIT = 3600.0
# No CPU that runs retrofit is slower than this (FLOP/s): below CPU_SECONDS_LIMIT at this rate, nothing is timed.
SLOWEST_CPU_FLOPS = 5e9
# Tokens of the timed forward.
TIMED_TOKENS = 256

_RATES: "weakref.WeakKeyDictionary[nn.Module, float]" = weakref.WeakKeyDictionary()


def forward_flops(model: nn.Module, tokens: int, logits: int = 1) -> float:
    """Floating-point operations of one causal forward of ``model`` over ``tokens`` tokens that computes the logits
    of ``logits`` positions (see the module doc): every weight of the decoder layers once per token, the attention of
    each softmax layer, and the output head once per position of logits."""
    layout = attention_layout(model)
    head = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight
    layers = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    attention = 2.0 * tokens * tokens * layout.num_heads * layout.head_dim * len(layout.softmax_layers)
    return 2.0 * layers * tokens + attention + 2.0 * head.numel() * logits


def cpu_flops_per_second(model: nn.Module) -> float:
    """The rate of ``model``'s forward on this CPU now: one forward of :data:`TIMED_TOKENS` tokens (logits at every
    position), timed after a short warm-up (memoized per model)."""
    if model in _RATES:
        return _RATES[model]
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.arange(TIMED_TOKENS, device=model_device(model)).remainder(vocab)[None]  # [1, TIMED_TOKENS]
    with torch.no_grad():
        model(ids[:, :16], use_cache=False)
        started = time.perf_counter()
        model(ids, use_cache=False)
        seconds = time.perf_counter() - started
    _RATES[model] = forward_flops(model, TIMED_TOKENS, logits=TIMED_TOKENS) / max(seconds, 1e-9)
    return _RATES[model]


def refuse_hours_on_cpu(model: nn.Module, what: str, tokens: int, items: int) -> None:
    """RetrofitError (one line, with what to do instead) when ``items`` prompts of ``tokens`` tokens each (a prefill
    and a few new tokens) would take more than :data:`CPU_SECONDS_LIMIT` on the CPU; nothing on any other device, and
    nothing is timed for a run that is short even on the slowest CPU."""
    if model_device(model).type != "cpu":
        return
    flops = items * forward_flops(model, tokens)
    if flops / SLOWEST_CPU_FLOPS <= CPU_SECONDS_LIMIT:
        return
    seconds = flops / cpu_flops_per_second(model)
    if seconds > CPU_SECONDS_LIMIT:
        raise RetrofitError(f"{what} would take about {seconds / 3600:.1f} h on this CPU ({items} items of {tokens:,} "
                            f"tokens, {seconds / items / 60:.0f} min each at the rate timed here): run it on a GPU "
                            "(--device cuda), or with fewer items (--limit) or a shorter --context-length")
