"""A softmax window (and sink tokens) inside a converted layer (``layer_spec: window``, ``retrofit.layers.window``).

The banded attention (blocks of queries over their own keys) is checked against the plain form (every query against
every key, an explicit mask) on awkward shapes; the whole windowed layer against a plain PyTorch reference written
here from its parameters (token-by-token recurrence, the plain window, the gate); its decode steps and chunked
prefill against one full forward; and, at initialisation, against the dense attention it replaces wherever a query
has no key out of its window (SmolLM2's real layer and every family whose rotation the window reproduces).
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import architecture_zoo as zoo
from retrofit import architecture
from retrofit.convert.build import to_hybrid
from retrofit.convert.init import calibrate_far_logits, init_from_attention
from retrofit.convert.objectives import AttentionCapture
from retrofit.hybrid import HybridSection
from retrofit.kernels import (gated_rms_norm_ref, l2_normalize_ref, log_decay_ref, naive_causal_conv1d,
                              naive_recurrent_gated_delta_rule, naive_recurrent_kda, use_backend)
from retrofit.layers import LAYER_TYPES, AttentionShape, LinearAttentionSpec
from retrofit.layers.modules import rotate
from retrofit.layers.window import (WindowRing, far_counts, near_share, prefill_window, real_indices,
                                    window_attention_reference)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LAYER = 5
TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting the steps as his father had done "
        "before him, and when he reached the lamp he paused to watch the ships come home across the grey water of "
        "the bay, one light after another, until the harbour was full and the night had fallen on the town.")


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def padded_rows(batch: int, length: int) -> torch.Tensor:
    """A keep mask with one row left-padded by 37 and, if there is a third row, one right-padded by 10."""
    keep = torch.ones(batch, length, dtype=torch.bool)
    if batch > 1 and length > 40:
        keep[1, :37] = False
    if batch > 2 and length > 20:
        keep[2, -10:] = False
    return keep


@pytest.mark.parametrize("length", [1, 63, 75, 150], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("window, sinks, softcap", [(1, 1, None), (5, 3, None), (64, 0, None), (70, 4, 2.5)],
                         ids=["w1s1", "w5s3", "w64", "w70s4-softcap"])
def test_banded_window_equals_the_plain_form(length, window, sinks, softcap):
    """6 query heads over 2 key-value heads, head dim 12, rows left- and right-padded, the first and last blocks
    partial: the blocks must find every key of every window and count sinks once."""
    torch.manual_seed(length + window)
    B, Hq, Hkv, D = 3, 6, 2, 12
    q, k, v = torch.randn(B, length, Hq, D), torch.randn(B, length, Hkv, D), torch.randn(B, length, Hkv, D)
    keep = padded_rows(B, length)
    out, lse, index, _ = prefill_window(q, k, v, keep, None, window, sinks, 0.3, softcap)
    ref, ref_lse = window_attention_reference(q, k, v, keep, window, sinks, 0.3, softcap)
    # float32 both ways, the same products summed in another order (blocks vs whole rows): ~1e-7 relative. A key
    # missed or counted twice moves outputs by O(1/window) and lse by O(1/window) too
    assert relative_rms(out, ref) < 1e-5
    assert (lse - ref_lse)[keep].abs().max().item() < 1e-5
    assert torch.equal(index, real_indices(keep, torch.zeros(B, dtype=torch.long), length))
    assert out[~keep].abs().max().item() == 0.0 if (~keep).any() else True


def test_a_ring_continues_a_prefill_exactly():
    """A prefill in three chunks (5, 1 and 70 tokens) through the ring gives the outputs of one prefill of all 76:
    the ring holds the last `window` real tokens in the slots the decode step reads, and the sinks."""
    torch.manual_seed(1)
    B, T, Hq, Hkv, D, window, sinks = 2, 76, 4, 2, 8, 9, 2
    q, k, v = torch.randn(B, T, Hq, D), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :3] = False  # left padding inside the first chunk
    whole, whole_lse, _, whole_ring = prefill_window(q, k, v, keep, None, window, sinks, 0.25, None)
    ring, pieces, lses = None, [], []
    for start, end in ((0, 5), (5, 6), (6, T)):
        out, lse, _, ring = prefill_window(q[:, start:end], k[:, start:end], v[:, start:end], keep[:, start:end],
                                           ring, window, sinks, 0.25, None)
        pieces.append(out)
        lses.append(lse)
    assert relative_rms(torch.cat(pieces, 1), whole) < 1e-6  # the same sums in the same order: rounding only
    assert torch.equal(ring.indices, whole_ring.indices) and torch.equal(ring.seen, whole_ring.seen)
    assert torch.equal(ring.keys, whole_ring.keys) and torch.equal(ring.sink_keys, whole_ring.sink_keys)
    # slot j % window holds real index j: the last 9 real tokens of each row (73 real in row 1)
    assert sorted(ring.indices[1].tolist()) == list(range(64, 73))
    assert all(int(ring.indices[1, j]) % window == j for j in range(window))


def test_near_share_is_one_without_far_keys_and_follows_the_normalisers():
    lse = torch.tensor([[[0.5], [0.5], [2.0]]])  # three queries, one head
    index = torch.tensor([[3, 10, 10]])  # window 4, sinks 2: the first has no far key, the others 5 (10-4-2+1)
    far = torch.zeros(1, 3, 1)
    share = near_share(lse, index, far, 4, 2)
    assert share[0, 0, 0].item() == 1.0
    expected = torch.sigmoid(torch.tensor([0.5, 2.0]) - torch.log(torch.tensor(5.0)))
    assert torch.allclose(share[0, 1:, 0], expected, rtol=0, atol=1e-7)
    assert far_counts(torch.tensor([0, 5, 6, 100]), 4, 2).tolist() == [0, 0, 1, 95]


@pytest.fixture(scope="module")
def attention_inputs(smollm2):
    """Real inputs and output of SmolLM2's layer-5 attention for two texts of 40 tokens: hidden_states [2, 40, 576],
    rotary (cos, sin), the attention's output [2, 40, 576]."""
    model, tokenizer = smollm2
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][:40] for text in (TEXT, TEXT.upper())]
    capture = AttentionCapture(model, [LAYER])
    try:
        record = capture.run(model, torch.tensor(rows))[LAYER]
    finally:
        capture.remove()
    return record["hidden_states"].detach(), record["position_embeddings"], record["target"].detach()


def windowed_layer(smollm2, kind: str, window: int, sinks: int) -> torch.nn.Module:
    """SmolLM2's layer 5 converted with a window, its data-dependent gates and far logits given some spread."""
    model, _ = smollm2
    facts = architecture.of(model).layers(model.config)[LAYER]
    layer = LAYER_TYPES.get(kind)(AttentionShape.from_config(model.config), LAYER,
                                  LinearAttentionSpec(window=window, sink_tokens=sinks), attention=facts)
    init_from_attention(layer, model.model.layers[LAYER].self_attn)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith(("a_proj.weight", "b_proj.weight", "g_proj.weight", "f_b_proj.weight", "g_b_proj.weight",
                              "far_logit_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            if name == "conv.weight":
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return layer.eval()


def plain_windowed_layer(layer, x: torch.Tensor, rotary, keep: torch.Tensor | None) -> torch.Tensor:
    """The windowed layer's output from its parameters, written plainly in float32: projections, the short conv
    (its reference), L2 norms, gates, the delta rule one token at a time, the gated norm; the window by the plain
    form; ``m`` from the normalisers; W_o. x ``[B, T, hidden]`` -> ``[B, T, hidden]``."""
    B, T, _ = x.shape
    hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    real = torch.ones(B, T, dtype=torch.bool) if keep is None else keep
    q_in, k_in, v_in = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    joined = torch.cat([q_in, k_in, v_in], -1) * real[..., None]
    conv = naive_causal_conv1d(joined, layer.conv.weight, layer.conv.bias, activation="silu")[0] * real[..., None]
    q, k, v = conv.split([hq * d, hk * d, hk * d], -1)
    q, k, v = l2_normalize_ref(q.view(B, T, hq, d)), l2_normalize_ref(k.view(B, T, hk, d)), v.view(B, T, hk, d)
    beta = torch.sigmoid(layer.b_proj(x)) * real[..., None]
    logits = layer.decay_logits(x)
    if layer.per_key_decay:
        logits = logits.unflatten(-1, (hk, d))
    g = log_decay_ref(logits, layer.A_log, layer.dt_bias, layer.per_key_decay, layer.decay_lower_bound)
    g = g * (real[..., None, None] if g.dim() == 4 else real[..., None])
    recurrent = naive_recurrent_kda if layer.per_key_decay else naive_recurrent_gated_delta_rule
    o = recurrent(q, k, v, g, beta)[0]
    linear = gated_rms_norm_ref(o, torch.sigmoid(layer.output_gate_logits(x)).view(B, T, hq, d), layer.o_norm.weight,
                                layer.o_norm.eps)
    wq, wk = rotate(q_in.view(B, T, hq, d), k_in.view(B, T, hk, d), rotary)
    near, lse = window_attention_reference(wq, wk, v_in.view(B, T, hk, d), keep, layer.window, layer.sink_tokens,
                                           layer.window_scale, layer.window_softcap)
    index = real_indices(keep, torch.zeros(B, dtype=torch.long), T)
    far = far_counts(index, layer.window, layer.sink_tokens)[..., None]
    share = torch.where(far > 0, torch.sigmoid(lse - torch.log(far.clamp_min(1).float()) - layer.far_logit_proj(x)),
                        torch.ones_like(lse))
    mixed = share[..., None] * near + (1 - share[..., None]) * linear
    return layer.o_proj(mixed.reshape(B, T, hq * d))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_windowed_layer_equals_its_plain_reference(smollm2, attention_inputs, kind, padded):
    hidden, rope, _ = attention_inputs
    layer = windowed_layer(smollm2, kind, window=7, sinks=2)
    keep = None
    if padded:
        keep = torch.ones(2, hidden.shape[1], dtype=torch.bool)
        keep[1, :9] = False
    mask = None if keep is None else keep.long()
    with torch.no_grad(), use_backend("torch"):
        fast = layer(hidden, position_embeddings=rope, attention_mask=mask)[0]
        plain = plain_windowed_layer(layer, hidden, rope, keep)
    # float32 both ways; the chunked delta rule against the token-by-token one and the banded window against the
    # plain one sum in other orders: ~1e-6 relative. A wrong gate, rotation or key set is off by >1e-2
    real = slice(None) if keep is None else keep
    assert relative_rms(fast[real], plain[real]) < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_steps_equal_the_prefill(smollm2, attention_inputs, kind, backend):
    """A left-padded batch: 17 tokens prefilled, then 5 more as a chunk, then 18 decode steps (the ring written and
    read in place), against one forward of all 40 tokens."""
    hidden, rope, _ = attention_inputs
    layer = windowed_layer(smollm2, kind, window=6, sinks=3)
    cos, sin = rope
    mask = torch.ones(2, hidden.shape[1], dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad(), use_backend(backend):
        full = layer(hidden, position_embeddings=rope, attention_mask=mask)[0]
        cache, pieces = DynamicCache(), []
        for start, end in ((0, 17), (17, 22)):
            pieces.append(layer(hidden[:, start:end], position_embeddings=(cos[:, start:end], sin[:, start:end]),
                                attention_mask=mask[:, :end], cache=cache)[0])
        ring = cache.layers[LAYER].retrofit_window_ring
        addresses = [t.data_ptr() for t in ring.tensors()]
        for t in range(22, hidden.shape[1]):
            pieces.append(layer(hidden[:, t:t + 1], position_embeddings=(cos[:, t:t + 1], sin[:, t:t + 1]),
                                cache=cache)[0])
    stepwise = torch.cat(pieces, dim=1)
    # the design doc's bar for chunk-vs-recurrent agreement in fp32: 1e-4 of the output's magnitude
    assert (stepwise - full)[:, 4:].abs().max().item() < 1e-4 * full.abs().max().item()
    assert [t.data_ptr() for t in ring.tensors()] == addresses  # decode wrote in place
    assert ring.seen.tolist() == [40, 36]


def test_a_windowed_layer_is_the_dense_attention_until_keys_fall_out_of_its_window(smollm2, attention_inputs):
    """SmolLM2's layer 5 converted with window 32 and 4 sinks, as initialised from the dense weights: for its first
    36 tokens every key is near, ``m = 1``, and the output is the dense attention's; at token 37 the first key goes
    far and the delta rule comes in."""
    hidden, rope, target = attention_inputs
    model, _ = smollm2
    facts = architecture.of(model).layers(model.config)[LAYER]
    layer = LAYER_TYPES.get("gdn")(AttentionShape.from_config(model.config), LAYER,
                                   LinearAttentionSpec(window=32, sink_tokens=4), attention=facts)
    init_from_attention(layer, model.model.layers[LAYER].self_attn)
    with torch.no_grad():
        out = layer.eval()(hidden, position_embeddings=rope)[0]
    # float32: the dense SDPA and the window's einsums differ by rounding (~1e-6 relative)
    assert relative_rms(out[:, :36], target[:, :36]) < 1e-5
    assert relative_rms(out[:, 36:], target[:, 36:]) > 1e-3


def test_calibration_sets_the_far_logit_to_the_dense_far_mass(smollm2, attention_inputs):
    """After calibration, averaged over positions, the window's share ``m`` of each query equals the share of the
    dense attention's mass on the window's keys, up to the spread over positions of the far keys' mean logit."""
    hidden, rope, _ = attention_inputs
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer(TEXT * 3, add_special_tokens=False)["input_ids"][:120]])
    facts = architecture.of(model).layers(model.config)
    layers = {}
    for index in (3, LAYER):
        layer = LAYER_TYPES.get("kda")(AttentionShape.from_config(model.config), index,
                                       LinearAttentionSpec(window=16, sink_tokens=1), attention=facts[index])
        init_from_attention(layer, model.model.layers[index].self_attn)
        layers[index] = layer.eval()
    applied = calibrate_far_logits(layers, model, ids)
    assert sorted(applied) == [3, LAYER]
    for index, layer in layers.items():
        assert layer.far_logit_proj.weight.abs().max().item() == 0.0
        assert torch.isfinite(layer.far_logit_proj.bias).all()
        assert layer.far_logit_proj.bias.std().item() > 0  # per head: heads spread their mass differently


@pytest.mark.parametrize("name", [row for row in dict.fromkeys(r.name for r in zoo.ROWS)
                                  if not architecture.for_type(zoo.BY_NAME[row].model_type).rotary_interleaved
                                  and not architecture.for_type(zoo.BY_NAME[row].model_type).already_hybrid])
def test_every_family_starts_as_its_dense_attention_inside_the_window(name):
    """For every family whose rotation the window reproduces (by halves): the windowed layer built from the dense
    one computes the dense attention for tokens with no far key: the record's scaling, softcap, rotary channels
    (partial, none on some layers) and q/k norms as the family's attention applies them. Layer 1 of the zoo's
    tiny models, 30 tokens, window 24 and 6 sinks."""
    dense = zoo.build(name).eval()
    base = architecture.base_model_type(dense.config)
    hybrid = to_hybrid(dense, HybridSection(layers=[1], layer_type="gdn", base_model_type=base,
                                            layer_spec={"window": 24, "sink_tokens": 6}))
    ids = torch.randint(3, zoo.VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))
    capture = AttentionCapture(dense, [1])
    try:
        record = capture.run(dense, ids)[1]
    finally:
        capture.remove()
    layer = architecture.of(hybrid).attention_module(hybrid, 1)
    with torch.no_grad():
        out = layer(hidden_states=record["hidden_states"], position_embeddings=record["position_embeddings"],
                    attention_mask=record["attention_mask"])[0]
    # float32; the family's SDPA or eager attention against the window's einsums: rounding only (~1e-6 relative)
    assert relative_rms(out, record["target"]) < 1e-5, name


def test_a_family_rotating_adjacent_pairs_is_refused_a_window(calib_data_dir, tmp_path, smollm2):
    from retrofit.convert.pipeline import convert
    from retrofit.errors import RetrofitError

    _, tokenizer = smollm2
    with pytest.raises(RetrofitError, match=r"^layer_spec window: glm rotates q and k by adjacent pairs"):
        convert((zoo.build("glm"), tokenizer), to="gdn", layers="0", data=[str(calib_data_dir)],
                out=tmp_path / "out", tokens=256, seq_len=64, batch_size=2, layer_spec={"window": 8},
                show_progress=False)
    assert not (tmp_path / "out").exists()


def test_the_ring_is_counted_in_the_layers_fixed_bytes(smollm2):
    model, _ = smollm2
    shape = AttentionShape.from_config(model.config)
    plain = LAYER_TYPES.get("gdn")(shape, 0, LinearAttentionSpec())
    windowed = LAYER_TYPES.get("gdn")(shape, 0, LinearAttentionSpec(window=64, sink_tokens=4))
    # SmolLM2: 3 kv heads x 64 dims, float32: keys and values of 68 tokens, 64 slot indices and the count (int64)
    assert windowed.state_bytes(2) - plain.state_bytes(2) == 2 * (2 * 68 * 3 * 64 * 4 + 8 * 65)
    ring = WindowRing.empty_like(torch.zeros(2, 1, 3, 64), 64, 4)
    assert ring.nbytes() == (windowed.state_bytes(2) - plain.state_bytes(2))


@pytest.mark.parametrize("values, message", [
    (dict(window=-1), "window must be an integer >= 0"), (dict(window=2.5), "window must be an integer >= 0"),
    (dict(sink_tokens=4), "sink_tokens 4 needs a window")])
def test_bad_window_settings_name_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        LinearAttentionSpec(**values)


def test_beam_search_moves_the_rings_rows_with_the_states():
    """Beam search reorders the cache's rows at every step: with the cache it gives the tokens it gives without one
    (every step recomputed from the whole sequence), so each ring row followed its beam. Zoo Llama, layers 0 and 2
    windowed (8 tokens, 2 sinks), prompts of 40 tokens, 4 beams."""
    dense = zoo.build("llama").eval()
    hybrid = to_hybrid(dense, HybridSection(layers=[0, 2], layer_type="kda", base_model_type="llama",
                                            layer_spec={"window": 8, "sink_tokens": 2}))
    ids = torch.randint(3, zoo.VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=10, min_new_tokens=10, num_beams=4, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
    with torch.no_grad():
        cached = hybrid.generate(input_ids=ids, **options)
        recomputed = hybrid.generate(input_ids=ids, use_cache=False, **options)
    assert torch.equal(cached, recomputed)
