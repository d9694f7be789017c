"""Triton short causal conv (prefill forward/backward, decode step) against the PyTorch reference.

CPU runs use the Triton interpreter in float32; bf16 checks are marked ``gpu``.
Tolerances: fp32 results differ from the reference only by summation order over W <= 4 taps and
T-long reductions (dweight, dbias), so 1e-5 relative RMS is ~100x the observed error and far below
any wrong-tap or off-by-one error (those give O(1) relative error).
"""

from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import causal_conv1d, causal_conv1d_update, naive_causal_conv1d, naive_causal_conv1d_update

FP32_TOL = 1e-5  # see module docstring
BF16_TOL = 5e-3  # bf16 inputs/outputs, fp32 accumulation: the FLA tolerance for bf16 outputs


def _inputs(B, T, D, W, *, bias, init, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen).to(device, dtype)
    weight = (torch.randn(D, W, generator=gen) / W ** 0.5).to(device, dtype)
    b = torch.randn(D, generator=gen).to(device, dtype) if bias else None
    state = torch.randn(B, D, W - 1, generator=gen).to(device, dtype) if init else None
    return x, weight, b, state


CASES = [
    # (B, T, D, W, activation, bias, initial_state): awkward T, D not a power of two and above one 128-wide block
    pytest.param(2, 1, 40, 4, "silu", True, True, id="T1-D40-W4-silu-bias-init"),
    pytest.param(2, 63, 130, 4, "silu", True, False, id="T63-D130-W4-silu-bias"),
    pytest.param(1, 75, 40, 4, None, False, True, id="T75-D40-W4-linear-init"),
    pytest.param(3, 75, 24, 3, "silu", False, True, id="T75-D24-W3-silu-init"),
    pytest.param(2, 2, 16, 4, "silu", True, True, id="T2-shorter-than-window"),
    pytest.param(1, 63, 16, 2, None, True, False, id="T63-W2-linear-bias"),
    pytest.param(1, 63, 16, 1, "silu", True, True, id="T63-W1-pointwise-empty-state"),
]


@pytest.mark.parametrize("B,T,D,W,activation,bias,init", CASES)
def test_prefill_forward_and_backward_match_reference(B, T, D, W, activation, bias, init):
    x, weight, b, state = _inputs(B, T, D, W, bias=bias, init=init)
    leaves = [t.requires_grad_(True) for t in (x, weight, b, state) if t is not None]
    with nan_poisoned_allocations():
        y, final = causal_conv1d(x, weight, b, activation, state, output_final_state=True)
    y_ref, final_ref = naive_causal_conv1d(x, weight, b, activation, state, output_final_state=True)
    assert torch.isfinite(y).all()
    assert rel_rms(y, y_ref) < FP32_TOL
    assert torch.equal(final, final_ref)  # a copy of inputs: exact

    gen = torch.Generator().manual_seed(1)
    dy, dfinal = torch.randn(y.shape, generator=gen), torch.randn(final.shape, generator=gen)
    with nan_poisoned_allocations():
        grads = torch.autograd.grad((y * dy).sum() + (final * dfinal).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + (final_ref * dfinal).sum(), leaves)
    for grad, grad_ref in zip(grads, grads_ref):
        assert torch.isfinite(grad).all()
        assert rel_rms(grad, grad_ref) < FP32_TOL


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("shape", ["B,D", "B,1,D", "B,D of wider rows", "B,1,D of wider rows"])
@pytest.mark.parametrize("activation,bias", [("silu", True), (None, False)], ids=["silu-bias", "linear"])
def test_update_matches_reference_and_rolls_state(W, shape, activation, bias):
    """``of wider rows``: x a column block of a wider buffer (q, k and v inside a merged projection's output), read
    in place with its row stride."""
    B, D = 3, 130
    x, weight, b, state = _inputs(B, 1, D, W, bias=bias, init=True)
    if shape.endswith("of wider rows"):
        wider = torch.randn(B, 1, D + 57, generator=torch.Generator().manual_seed(3))
        wider[:, :, 11:11 + D] = x
        x = wider[:, :, 11:11 + D]
    x = x[:, 0] if shape.startswith("B,D") else x
    state_ref = state.clone()
    with nan_poisoned_allocations():
        y = causal_conv1d_update(x, state, weight, b, activation)
    y_ref = naive_causal_conv1d_update(x, state_ref, weight, b, activation)
    assert y.shape == x.shape
    assert rel_rms(y, y_ref) < FP32_TOL
    assert torch.equal(state, state_ref)  # rolled copy of inputs: exact
    assert torch.equal(state[:, :, -1], x.reshape(B, D))


def test_prefill_then_decode_equals_one_prefill():
    """Prefill 50 tokens with the final state, then 13 decode steps == one prefill over all 63 tokens."""
    B, T, D, W, split = 2, 63, 40, 4, 50
    x, weight, b, _ = _inputs(B, T, D, W, bias=True, init=False)
    y_full, _ = causal_conv1d(x, weight, b, "silu")
    y_head, state = causal_conv1d(x[:, :split], weight, b, "silu", output_final_state=True)
    steps = [causal_conv1d_update(x[:, t], state, weight, b, "silu") for t in range(split, T)]
    y_joined = torch.cat([y_head, torch.stack(steps, 1)], 1)
    assert (y_joined - y_full).abs().max() < 1e-6  # same per-position arithmetic, fp32 roundoff only


def test_bad_inputs_raise_clear_errors():
    x, weight, b, state = _inputs(1, 4, 8, 4, bias=True, init=True)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, b, "gelu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, b, "silu", state[:, :, :2])
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:, 0], state[:, :, :2].contiguous(), weight, b)
    with pytest.raises(ValueError, match="W >= 2"):
        causal_conv1d_update(x[:, 0], state[:, :, :0].contiguous(), weight[:, :1].contiguous(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 75, 4096])
def test_bf16_prefill_and_update_on_gpu(T):
    """bf16 kernel vs the fp32 reference on the same (bf16-valued) inputs: only the kernel's own rounding differs."""
    B, D, W = 2, 1536, 4
    x, weight, b, state = _inputs(B, T, D, W, bias=True, init=True, dtype=torch.bfloat16, device="cuda")
    leaves = [t.requires_grad_(True) for t in (x, weight, b, state)]
    leaves_ref = [t.detach().float().requires_grad_(True) for t in leaves]
    y, final = causal_conv1d(*leaves[:3], "silu", leaves[3], output_final_state=True)
    y_ref, final_ref = naive_causal_conv1d(*leaves_ref[:3], "silu", leaves_ref[3], output_final_state=True)
    assert rel_rms(y, y_ref) < BF16_TOL
    assert torch.equal(final.float(), final_ref)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * dy.float()).sum(), leaves_ref)
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_rms(grad, grad_ref) < BF16_TOL
    conv_state = state.detach().clone()
    conv_state_ref = conv_state.float()
    x_step = x[:, 0].detach()
    y_step = causal_conv1d_update(x_step, conv_state, weight.detach(), b.detach(), "silu")
    y_step_ref = naive_causal_conv1d_update(x_step.float(), conv_state_ref, weight.detach().float(),
                                            b.detach().float(), "silu")
    assert rel_rms(y_step, y_step_ref) < BF16_TOL
    assert torch.equal(conv_state.float(), conv_state_ref)
