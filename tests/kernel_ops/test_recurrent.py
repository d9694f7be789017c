"""Recurrent (decode) GDN / KDA Triton kernels against K1's token-by-token references.

CPU runs use the Triton interpreter in float32; bf16 and CUDA-graph checks are marked ``gpu``.
Tolerance FP32_TOL: kernel and reference run the same fp32 recurrence with different summation
order inside the K-length dot products; the observed relative RMS is ~1e-7, and any real bug (wrong
head, wrong decay, a missed step) gives O(1e-1) or more, so 1e-5 separates the two cleanly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import (
    RecurrentDecodeGraph,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_kda,
)

FP32_TOL = 1e-5  # see module docstring
BF16_TOL = 5e-3  # bf16 q/k/v/o with fp32 state: FLA's tolerance for bf16 outputs

OPS = {
    "gdn": (fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule),
    "kda": (fused_recurrent_kda, naive_recurrent_kda),
}
CHUNK = {"gdn": chunk_gated_delta_rule, "kda": chunk_kda}


def _inputs(kind, B, T, H, K, V, *, group=1, init=True, g_scale=1.0, seed=0, dtype=torch.float32, device="cpu"):
    """q [B,T,group*H,K], k (unit rows) [B,T,H,K], v, g <= 0 ([B,T,H] or [B,T,H,K]), beta in (0,1), state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, group * H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g_shape = (B, T, H, K) if kind == "kda" else (B, T, H)
    g = F.logsigmoid(torch.randn(g_shape, generator=gen) + 2.0) * g_scale
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    state = torch.randn(B, H, K, V, generator=gen) if init else None
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    g, beta = g.to(device), beta.to(device)
    state = state.to(device) if state is not None else None
    return q, k, v, g, beta, state


def _check_against_reference(kind, q, k, v, g, beta, state, tol=FP32_TOL):
    fused, naive = OPS[kind]
    with nan_poisoned_allocations():
        o, final = fused(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_ref, final_ref = naive(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert o.shape == o_ref.shape and o.dtype == v.dtype
    assert final.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms(o, o_ref) < tol
    assert rel_rms(final, final_ref) < tol
    return o, final


# (H, K, V): non-power-of-two head count, K != V, and V = 64 split into two V blocks (kernel tiling);
# H=3 with K=V=64 is left out only to keep the interpreter run short (heads and V blocks are independent axes)
HEAD_SHAPES = [
    pytest.param(1, 16, 16, id="H1-K16V16"),
    pytest.param(3, 16, 16, id="H3-K16V16"),
    pytest.param(1, 32, 16, id="H1-K32V16"),
    pytest.param(3, 32, 16, id="H3-K32V16"),
    pytest.param(1, 64, 64, id="H1-K64V64"),
]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T", [1, 63, 75])
@pytest.mark.parametrize("H,K,V", HEAD_SHAPES)
def test_matches_reference(kind, T, H, K, V):
    _check_against_reference(kind, *_inputs(kind, 1, T, H, K, V))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T", [1, 63])
def test_zero_initial_state_matches_reference(kind, T):
    _check_against_reference(kind, *_inputs(kind, 2, T, 3, 32, 16, init=False))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("B,T,H,group", [(1, 63, 3, 3), (1, 75, 1, 4), (3, 1, 3, 3)],
                         ids=["B1-T63-H3x3", "B1-T75-H1x4", "B3-T1-H3x3"])
def test_grouped_query_heads_read_their_kv_state(kind, B, T, H, group):
    _check_against_reference(kind, *_inputs(kind, B, T, H, 16, 16, group=group))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_awkward_head_dims_are_masked(kind):
    """K, V not powers of two: the masked lanes must neither leak into the state nor be written."""
    _check_against_reference(kind, *_inputs(kind, 1, 63, 2, 24, 40))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_inplace_state_updates_the_callers_buffer(kind):
    fused, _ = OPS[kind]
    q, k, v, g, beta, state = _inputs(kind, 2, 20, 3, 16, 16, group=3)
    o_copy, final_copy = fused(q, k, v, g, beta, initial_state=state, output_final_state=True)
    buffer = state.clone()
    with nan_poisoned_allocations():
        o, returned = fused(q, k, v, g, beta, initial_state=buffer, inplace_state=True)
    assert returned.data_ptr() == buffer.data_ptr()  # no new state tensor
    assert torch.equal(buffer, final_copy) and torch.equal(o, o_copy)  # identical arithmetic: exact


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_steps_equal_one_call(kind):
    """12 single-token in-place calls == one T=12 call (same kernel arithmetic per step)."""
    fused, _ = OPS[kind]
    q, k, v, g, beta, state = _inputs(kind, 2, 12, 3, 16, 16, group=3)
    o_all, final_all = fused(q, k, v, g, beta, initial_state=state, output_final_state=True)
    buffer = state.clone()
    steps = [fused(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                   initial_state=buffer, inplace_state=True)[0] for t in range(12)]
    assert torch.equal(torch.cat(steps, 1), o_all) and torch.equal(buffer, final_all)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_padded_position_leaves_state_unchanged(kind):
    """g = 0, beta = 0, k = v = 0 is the identity on the state: exactly, not approximately."""
    fused, _ = OPS[kind]
    q, k, v, g, beta, state = _inputs(kind, 2, 5, 3, 32, 16)
    k[:, 2], v[:, 2], g[:, 2], beta[:, 2] = 0, 0, 0, 0
    _, padded_only = fused(q[:, 2:3], k[:, 2:3], v[:, 2:3], g[:, 2:3], beta[:, 2:3], initial_state=state,
                           output_final_state=True)
    assert torch.equal(padded_only, state)
    keep = [0, 1, 3, 4]
    o_pad, final_pad = fused(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_skip, final_skip = fused(q[:, keep], k[:, keep], v[:, keep], g[:, keep], beta[:, keep], initial_state=state,
                               output_final_state=True)
    assert torch.equal(final_pad, final_skip) and torch.equal(o_pad[:, keep], o_skip)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_strong_decay_stays_finite(kind):
    """g = -5 at every step (the lower bound FLA recommends): the state decays by e^-5 per step, no under/overflow."""
    q, k, v, g, beta, state = _inputs(kind, 1, 75, 2, 16, 16)
    g = torch.full_like(g, -5.0)
    _check_against_reference(kind, q, k, v, g, beta, state)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_chunk_prefill_then_recurrent_decode_equals_one_chunk_call(kind):
    """Prefill 70 tokens with the chunk kernel (crossing a 64-token chunk boundary), decode 5 more token by
    token with the recurrent kernel in place, and compare with one chunk call over all 75 tokens.
    Tolerance 1e-4 max abs (the design doc's criterion); fp32 roundoff of two factorisations is ~1e-6."""
    q, k, v, g, beta, state = _inputs(kind, 1, 75, 3, 32, 32, group=3)
    split = 70
    o_full, final_full = CHUNK[kind](q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_prefill, running = CHUNK[kind](q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split],
                                     initial_state=state, output_final_state=True)
    fused, _ = OPS[kind]
    decoded = [fused(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                     initial_state=running, inplace_state=True)[0] for t in range(split, 75)]
    o_joined = torch.cat([o_prefill, *decoded], 1)
    assert (o_joined - o_full).abs().max() < 1e-4
    assert (running - final_full).abs().max() < 1e-4


def test_bad_inputs_raise_clear_errors():
    q, k, v, g, beta, state = _inputs("kda", 1, 3, 2, 16, 16)
    with pytest.raises(ValueError, match=r"g must be \[1, 3, 2, 16\]"):
        fused_recurrent_kda(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="inplace_state=True needs initial_state"):
        fused_recurrent_gated_delta_rule(q, k, v, g[..., 0], beta, inplace_state=True)
    with pytest.raises(ValueError, match="q must be"):
        fused_recurrent_gated_delta_rule(q[:, :, :1].repeat(1, 1, 3, 1), k, v, g[..., 0], beta)


def test_decode_value_block_widens_with_the_batch(monkeypatch):
    # DECODE_WIDE_BV where the programs still fill the SMs twice over, narrower blocks down to the thin one else
    from retrofit.kernels.gated_delta_rule import fused_recurrent as fr
    monkeypatch.setattr(fr, "_LAUNCH_CONFIG", {})
    monkeypatch.setattr(fr, "_INTERPRETED", False)
    monkeypatch.setattr(fr, "multiprocessors", lambda device: 132)     # an H200
    cuda = torch.device("cuda")
    blocks = {B: fr._launch_config(B, 32, 128, 128, cuda)[1:] for B in (1, 4, 16, 64)}
    # (BK, BV, warps): B=1 64 / 128 / 256 programs at 64 / 32 / 16 values < 264, the thin block; B=4 512 at 32
    assert blocks == {1: (128, 8, 1), 4: (128, 32, 4), 16: (128, 64, 4), 64: (128, 64, 4)}
    assert fr._launch_config(64, 32, 128, 128, cuda)[0] == (2, 64 * 32)
    assert fr._launch_config(2, 3, 64, 48, cuda)[1:] == (64, 16, 1)       # 6 slices: thin, V = 48 masked
    monkeypatch.setattr(fr, "multiprocessors", lambda device: None)    # off CUDA
    assert fr._launch_config(64, 32, 128, 128, torch.device("cpu"))[1:] == (128, 8, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
# B=64, H=8: 1024 programs of 64 values, the wide decode block (DECODE_WIDE_BV) with grouped query heads
@pytest.mark.parametrize("B,T,H,group,K,V", [(1, 1, 32, 1, 128, 128), (4, 75, 3, 3, 64, 64), (64, 1, 8, 4, 128, 128)])
def test_bf16_matches_fp32_reference_on_gpu(kind, B, T, H, group, K, V):
    """bf16 q/k/v, fp32 g/beta/state vs the fp32 reference on the same bf16-valued inputs."""
    q, k, v, g, beta, state = _inputs(kind, B, T, H, K, V, group=group, dtype=torch.bfloat16, device="cuda")
    fused, naive = OPS[kind]
    o, final = fused(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o_ref, final_ref = naive(q.float(), k.float(), v.float(), g, beta, initial_state=state, output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert rel_rms(o, o_ref) < BF16_TOL
    assert rel_rms(final, final_ref) < BF16_TOL


def test_decode_graph_rejects_a_state_it_cannot_capture():
    with pytest.raises(ValueError, match="contiguous float32 CUDA tensor"):
        RecurrentDecodeGraph(torch.zeros(1, 2, 16, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_cuda_graph_decode_equals_plain_launches(kind):
    fused, _ = OPS[kind]
    B, T, H, group, K, V = 2, 8, 4, 2, 128, 128
    q, k, v, g, beta, state = _inputs(kind, B, T, H, K, V, group=group, dtype=torch.bfloat16, device="cuda")
    plain_state = state.clone()
    graph_state = state.clone()
    step = RecurrentDecodeGraph(graph_state, num_query_heads=H * group, per_key_decay=kind == "kda")
    assert torch.equal(graph_state, state)  # building the graph does not touch the state
    for t in range(T):
        o_plain, _ = fused(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                           initial_state=plain_state, inplace_state=True)
        o_graph = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1])
        assert torch.equal(o_graph, o_plain)  # same kernel, same inputs: bitwise equal
    assert torch.equal(graph_state, plain_state)
