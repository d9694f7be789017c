"""Converted layers (Gated DeltaNet, KDA) built from SmolLM2's real attention weights, fed its real hidden states.

Triton runs through its interpreter on the CPU (conftest sets TRITON_INTERPRET), so the Triton paths are checked on
short sequences; the PyTorch chunked path (the CPU backend) is checked against them.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from retrofit.convert.distill import AttentionCapture
from retrofit.convert.init import init_from_attention
from retrofit.layers import LAYER_TYPES, AttentionShape, LinearAttentionSpec
from retrofit.kernels import use_backend


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


LAYER = 5
TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting the steps as his father had "
        "done before him, and when he reached the lamp he paused to watch the ships come home across the grey "
        "water of the bay, one light after another, until the harbour was full and the night had fallen.")


@pytest.fixture(scope="module")
def attention_inputs(smollm2):
    """Real inputs of SmolLM2's layer-5 attention for two sentences: hidden_states [2, T, 576] and rotary (cos, sin)."""
    model, tokenizer = smollm2
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][:37] for text in (TEXT, TEXT.upper())]
    assert all(len(row) == 37 for row in rows)
    ids = torch.tensor(rows)
    capture = AttentionCapture(model, [LAYER])
    try:
        record = capture.run(model, ids)[LAYER]
    finally:
        capture.remove()
    return record["hidden_states"].detach(), record["position_embeddings"]


def make_layer(smollm2, kind: str, **spec) -> torch.nn.Module:
    model, _ = smollm2
    layer = LAYER_TYPES.get(kind)(AttentionShape.from_config(model.config), LAYER, LinearAttentionSpec(**spec))
    init_from_attention(layer, model.model.layers[LAYER].self_attn)
    # Give the data-dependent gates some spread so the test exercises them (they start constant).
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith(("a_proj.weight", "b_proj.weight", "g_proj.weight", "f_b_proj.weight", "g_b_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            if name == "conv.weight":
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer.eval()


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_torch_chunk_matches_triton_chunk(smollm2, attention_inputs, kind):
    hidden, rope = attention_inputs
    layer = make_layer(smollm2, kind)
    with torch.no_grad():
        with use_backend("torch"):
            reference = layer(hidden, position_embeddings=rope)[0]
        with use_backend("triton"):
            fast = layer(hidden, position_embeddings=rope)[0]
    scale = reference.abs().max().item()
    # fp32 both ways; the two chunked forms sum in different orders: agreement to ~1e-6 relative is expected,
    # 1e-4 of the output's magnitude leaves room for Triton's fp32 dot products (tf32 is off in the interpreter)
    assert (reference - fast).abs().max().item() <= 1e-4 * scale


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_prefill_then_decode_equals_full_forward(smollm2, attention_inputs, kind, backend):
    """Chunk path over 20 tokens into the cache, then 17 single-token steps (recurrent kernel + conv update)."""
    hidden, rope = attention_inputs
    layer = make_layer(smollm2, kind)
    T, prefill = hidden.shape[1], 20
    cos, sin = rope
    with torch.no_grad(), use_backend(backend):
        full = layer(hidden, position_embeddings=rope)[0]
        cache = DynamicCache()
        pieces = [layer(hidden[:, :prefill], position_embeddings=(cos[:, :prefill], sin[:, :prefill]), cache=cache)[0]]
        for t in range(prefill, T):
            pieces.append(layer(hidden[:, t:t + 1], position_embeddings=(cos[:, t:t + 1], sin[:, t:t + 1]),
                                cache=cache)[0])
    stepwise = torch.cat(pieces, dim=1)
    # the design doc's bar for chunk-vs-recurrent agreement in fp32 is 1e-4 absolute; outputs here are O(1)
    assert (stepwise - full).abs().max().item() < 1e-4 * max(1.0, full.abs().max().item())
    state = cache.layers[LAYER].recurrent_states[0]
    # GQA: one fp32 state per key-value head (SmolLM2 has 3), not per query head (9)
    assert state.shape == (2, 3, 64, 64) and state.dtype == torch.float32


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_padding_positions_are_identity(smollm2, attention_inputs, kind):
    """Left padding (as in batched generation) leaves the real tokens' outputs unchanged; padded rows output 0."""
    hidden, rope = attention_inputs
    layer = make_layer(smollm2, kind)
    pad = 5
    T = hidden.shape[1]
    padded = torch.cat([torch.randn(2, pad, hidden.shape[-1]), hidden], dim=1)
    mask = torch.ones(2, T + pad, dtype=torch.long)
    mask[:, :pad] = 0
    cos, sin = rope
    with torch.no_grad():
        plain = layer(hidden, position_embeddings=rope)[0]
        shifted_rope = (torch.cat([cos[:, :pad], cos], 1), torch.cat([sin[:, :pad], sin], 1))
        out = layer(padded, position_embeddings=shifted_rope, attention_mask=mask)[0]
    # same recurrence, but the padding shifts the chunk boundaries (a different chunked factorisation of it):
    # fp32 rounding differences of ~1e-5 relative; 1e-4 of the output's magnitude, as for chunk vs Triton
    assert (out[:, pad:] - plain).abs().max().item() < 1e-4 * max(1.0, plain.abs().max().item())
    bias_only = layer.o_proj.bias if layer.o_proj.bias is not None else 0.0
    assert (out[:, :pad] - bias_only).abs().max().item() == 0.0


def test_expanded_kv_heads_equal_grouped_heads_at_init(smollm2, attention_inputs):
    """Repeating each kv head for its query heads (more state) computes the same function as sharing one state per
    kv head when both start from the same attention weights: this pins the kernel's GQA convention (query head h
    reads kv head h // group) to the attention's (repeat_kv)."""
    hidden, rope = attention_inputs
    model, _ = smollm2
    shape = AttentionShape.from_config(model.config)
    grouped = LAYER_TYPES.get("gdn")(shape, LAYER, LinearAttentionSpec())
    expanded = LAYER_TYPES.get("gdn")(shape, LAYER, LinearAttentionSpec(expand_kv=True))
    for layer in (grouped, expanded):
        init_from_attention(layer, model.model.layers[LAYER].self_attn)
        layer.double()
    assert expanded.k_proj.weight.shape[0] == 3 * grouped.k_proj.weight.shape[0]
    rope64 = (rope[0].double(), rope[1].double())
    with torch.no_grad(), use_backend("torch"):
        a = grouped(hidden.double(), position_embeddings=rope64)[0]
        b = expanded(hidden.double(), position_embeddings=rope64)[0]
    # the same function computed with differently batched heads in float64, except the short conv (the kernels'
    # reference conv computes in float32): float32 rounding, ~2e-8 relative; a wrong head mapping is off by O(1)
    assert (a - b).abs().max().item() < 1e-6 * a.abs().max().item()


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gradients_torch_path_match_triton_path(smollm2, attention_inputs, kind):
    """Training on the CPU goes through the PyTorch chunked form; its parameter gradients match the Triton chunk
    kernels' backward on the same loss."""
    hidden, rope = attention_inputs
    grads = {}
    for backend in ("torch", "triton"):
        layer = make_layer(smollm2, kind).train()
        with use_backend(backend):
            out = layer(hidden[:1, :24], position_embeddings=(rope[0][:1, :24], rope[1][:1, :24]))[0]
        out.pow(2).mean().backward()
        grads[backend] = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    assert grads["torch"].keys() == grads["triton"].keys() and len(grads["torch"]) > 10
    for name, g in grads["torch"].items():
        other = grads["triton"][name]
        # relative RMS error per tensor; FLA's tests accept 5e-3 for bf16, fp32 should be far tighter than 1e-3
        err = (g - other).pow(2).mean().sqrt() / g.pow(2).mean().sqrt().clamp_min(1e-12)
        assert err < 1e-3, f"{name}: relative RMS error {err:.2e}"


def test_new_parameters_start_near_identity(smollm2):
    """Conv = identity tap, output gate ~ gate_init, decay in [-decay_max, -decay_min] (slow forgetting)."""
    spec = LinearAttentionSpec()
    model, _ = smollm2
    layer = LAYER_TYPES.get("kda")(AttentionShape.from_config(model.config), LAYER, spec)
    x = torch.randn(1, 4, model.config.hidden_size)
    with torch.no_grad():
        g = layer.decay(x)
        gate = layer.output_gate(x)
    assert torch.equal(layer.conv.weight[:, -1], torch.ones(layer.conv.channels))
    assert layer.conv.weight[:, :-1].abs().max() == 0
    # softplus(inverse_softplus(dt)) = dt up to float32 rounding (relative 1e-5)
    assert g.max().item() <= -spec.decay_min * (1 - 1e-5) and g.min().item() >= -spec.decay_max * (1 + 1e-5)
    assert torch.allclose(gate, torch.full_like(gate, spec.gate_init), atol=1e-6)
