"""A GDN / KDA layer's decode token after its conv (``delta_rule_decode_step``: q/k norms, gates and one recurrence
step in one kernel) and its sigmoid-gated output norm (``sigmoid_gated_rms_norm``), against their PyTorch references.

CPU: Triton interpreter, float32. FP32_TOL = 1e-5 relative RMS, as for the recurrent kernel: the same fp32 math in
another summation order inside the norms and the K-length dot products (observed ~1e-7); a wrong head, channel,
gate or decay moves the output or the state by O(1e-1) or more.
GPU (marked ``gpu``): bfloat16 inputs, fp32 state. BF16_TOL = 1e-2: kernel and reference round q, k (after their
norms) and o to bf16 at the same points, but from fp32 values that differ in their last bits, so an element may land
one bf16 ulp (2^-8 relative) away, and the step's output is a sum over the head's channels of such values.
Every buffer the kernels allocate is NaN-poisoned, so unwritten memory fails the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import (
    delta_rule_decode_step,
    delta_rule_decode_step_ref,
    sigmoid_gated_rms_norm,
    sigmoid_gated_rms_norm_ref,
)

FP32_TOL = 1e-5  # see module docstring
BF16_TOL = 1e-2  # see module docstring

# (batch, kv heads, query heads per kv head, head dim): non-powers of two, GQA groups of 1 and 3, SmolLM2's layout
CASES = {"B1-H1-G1-D16": (1, 1, 1, 16), "B2-H3-G3-D48": (2, 3, 3, 48), "B3-H3-G3-D64-smollm2": (3, 3, 3, 64)}


def _inputs(B, H, group, D, per_key, dtype=torch.float32, device="cpu", seed=0):
    """qkv [B, (Hq + 2H) D] of unnormalised q, k (the kernel normalises them), decay and beta logits with spread
    across the softplus's range (some past its threshold 20), A_log, dt_bias and a random fp32 state."""
    gen = torch.Generator().manual_seed(seed)
    Hq = H * group
    qkv = torch.randn(B, (Hq + 2 * H) * D, generator=gen) * 2
    decay_logits = torch.randn(B, H * D if per_key else H, generator=gen) * 4
    decay_logits.view(-1)[0] = 25.0  # past the softplus threshold
    beta_logits = torch.randn(B, H, generator=gen)
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(H * D if per_key else H, generator=gen)
    state = torch.randn(B, H, D, D, generator=gen)
    cast = [t.to(device, dtype) for t in (qkv, decay_logits, beta_logits, A_log, dt_bias)]
    return (*cast, state.to(device))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_decode_step_matches_reference_fp32(kind, case):
    """The output of every query head and the state updated in place, within FP32_TOL; KDA with its lower bound on
    the decay (some channels reach it at these logits), GDN without."""
    B, H, group, D = CASES[case]
    per_key = kind == "kda"
    qkv, decay_logits, beta_logits, A_log, dt_bias, state = _inputs(B, H, group, D, per_key)
    lower = -5.0 if per_key else None
    expected_state = state.clone()
    expected = delta_rule_decode_step_ref(qkv, decay_logits, beta_logits, A_log, dt_bias, expected_state, H * group,
                                          per_key, lower)
    before = state.clone()
    with nan_poisoned_allocations():
        out = delta_rule_decode_step(qkv, decay_logits, beta_logits, A_log, dt_bias, state, H * group, per_key, lower)
    assert out.shape == expected.shape == (B, H * group, D)
    assert rel_rms(out, expected) < FP32_TOL
    assert rel_rms(state, expected_state) < FP32_TOL
    assert rel_rms(state, before) > 1e-2  # the step did move the state


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_decode_step_reads_rows_of_a_wider_buffer(kind):
    """qkv and the logits may be rows of wider buffers (a merged projection's output): the kernel reads them by
    their row stride."""
    B, H, group, D = CASES["B2-H3-G3-D48"]
    per_key = kind == "kda"
    qkv, decay_logits, beta_logits, A_log, dt_bias, state = _inputs(B, H, group, D, per_key, seed=1)
    wide = torch.zeros(B, qkv.shape[1] + 7)
    wide[:, 3 : 3 + qkv.shape[1]] = qkv
    expected_state = state.clone()
    expected = delta_rule_decode_step_ref(qkv, decay_logits, beta_logits, A_log, dt_bias, expected_state, H * group,
                                          per_key)
    out = delta_rule_decode_step(wide[:, 3 : 3 + qkv.shape[1]], decay_logits, beta_logits, A_log, dt_bias, state,
                                 H * group, per_key)
    assert rel_rms(out, expected) < FP32_TOL and rel_rms(state, expected_state) < FP32_TOL


def test_decode_step_rejects_shapes_that_do_not_fit():
    qkv, decay_logits, beta_logits, A_log, dt_bias, state = _inputs(2, 3, 3, 16, False)
    with pytest.raises(ValueError, match="qkv"):
        delta_rule_decode_step(qkv[:, :-16], decay_logits, beta_logits, A_log, dt_bias, state, 9, False)
    with pytest.raises(ValueError, match="decay_logits"):
        delta_rule_decode_step(qkv, decay_logits, beta_logits, A_log, dt_bias, state, 9, True)


# o [..., H, D] of a decode token and of a short prefill, non-powers of two
NORM_CASES = {"B1x1-H9-D64": (1, 1, 9, 64), "B3x1-H3-D48": (3, 1, 3, 48), "B2x5-H2-D100": (2, 5, 2, 100)}


@pytest.mark.parametrize("wider_rows", [False, True], ids=["", "logits-of-wider-rows"])
@pytest.mark.parametrize("case", list(NORM_CASES), ids=list(NORM_CASES))
def test_sigmoid_gated_rms_norm_matches_reference_fp32(case, wider_rows):
    """``wider_rows``: the logits a column block of a wider buffer (a merged projection's output), read in place."""
    shape = NORM_CASES[case]
    gen = torch.Generator().manual_seed(2)
    o, logits = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen) * 2
    if wider_rows:
        H, D = shape[-2:]
        wider = torch.randn(*shape[:-2], H * D + 13, generator=gen)
        wider[..., 5:5 + H * D] = logits.flatten(-2)
        logits = wider[..., 5:5 + H * D].unflatten(-1, (H, D))
        assert logits.storage_offset() == 5  # (and tokens H * D + 13 apart where there are several)
    weight = torch.rand(shape[-2:], generator=gen) + 0.5  # per head: a wrong head's weight shows
    with nan_poisoned_allocations():
        out = sigmoid_gated_rms_norm(o, logits, weight, 1e-6)
    expected = sigmoid_gated_rms_norm_ref(o, logits, weight, 1e-6)
    assert out.shape == expected.shape and rel_rms(out, expected) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("B,H,group,D", [(1, 8, 4, 128), (8, 8, 4, 128), (3, 3, 3, 64)])
def test_decode_step_bf16_gpu(kind, B, H, group, D):
    per_key = kind == "kda"
    qkv, decay_logits, beta_logits, A_log, dt_bias, state = _inputs(B, H, group, D, per_key, torch.bfloat16, "cuda")
    lower = -5.0 if per_key else None
    expected_state = state.clone()
    expected = delta_rule_decode_step_ref(qkv, decay_logits, beta_logits, A_log, dt_bias, expected_state, H * group,
                                          per_key, lower)
    out = delta_rule_decode_step(qkv, decay_logits, beta_logits, A_log, dt_bias, state, H * group, per_key, lower)
    assert rel_rms(out, expected) < BF16_TOL
    assert rel_rms(state, expected_state) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(NORM_CASES), ids=list(NORM_CASES))
def test_sigmoid_gated_rms_norm_bf16_gpu(case):
    shape = NORM_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(2)
    o = (torch.randn(shape, generator=gen, device="cuda") * 3).bfloat16()
    logits = (torch.randn(shape, generator=gen, device="cuda") * 2).bfloat16()
    weight = (torch.rand(shape[-2:], generator=gen, device="cuda") + 0.5).bfloat16()
    out = sigmoid_gated_rms_norm(o, logits, weight, 1e-6)
    # one rounding to bf16 at the end of the same fp32 math: half an ulp (2^-9) RMS at most, the statistics' last bits
    assert rel_rms(out, sigmoid_gated_rms_norm_ref(o, logits, weight, 1e-6)) < 4e-3
