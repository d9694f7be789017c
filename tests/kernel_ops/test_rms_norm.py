"""RMSNorm and residual-add + RMSNorm Triton kernels against their PyTorch reference (kernels/rms_norm/reference.py),
and the reference against transformers' ``LlamaRMSNorm`` (the semantics the decode step must keep).

CPU: Triton interpreter, float32. FP32_TOL = 1e-6 relative RMS: kernel and reference compute the same float32 math
and differ only in the order of the mean square's summation (observed ~1e-7); a wrong row, a missing weight or an
unnormalised row gives errors of order 1e-1 or more. The residual sum is one float32 addition in both: compared exactly.
GPU (marked ``gpu``): bfloat16. BF16_TOL = 4e-3, half a bf16 ulp in RMS: both round the sum, the normalised value and
the product with the weight to bf16 at the same points, so only elements whose float32 statistics differ in the last
bits round differently (by one ulp, a small fraction of them); anything wrong is of order 1e-1. The sum is exact.
Every buffer the kernel allocates is NaN-poisoned, so unwritten memory fails the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref

FP32_TOL = 1e-6  # see module docstring
BF16_TOL = 4e-3  # see module docstring

# shape of x (the last dimension is the hidden size): batch 1 and 3, a decode token [B, 1, H], non-powers of two
CASES = {
    "B1-H64": (1, 64),
    "B3-H576-smollm2": (3, 576),
    "B3x1-H100": (3, 1, 100),
    "B1x1-H4096-llama3": (1, 1, 4096),
    "B2x5-H72": (2, 5, 72),
}
EPS = 1e-5


def _inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    residual = torch.randn(shape, generator=gen)
    weight = 1 + 0.5 * torch.randn(shape[-1], generator=gen)
    return x.to(device, dtype), residual.to(device, dtype), weight.to(device, dtype)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rms_norm_matches_reference_fp32(case):
    x, _, weight = _inputs(CASES[case])
    with nan_poisoned_allocations():
        out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_rms(out, rms_norm_ref(x, weight, EPS)) < FP32_TOL


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_add_rms_norm_matches_reference_fp32(case):
    x, residual, weight = _inputs(CASES[case])
    with nan_poisoned_allocations():
        normed, summed = add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_summed = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(summed, expected_summed)
    assert rel_rms(normed, expected_normed) < FP32_TOL


def test_rms_norm_reads_a_strided_input_and_keeps_its_inputs():
    """A view with a row stride (a column slice) is read as its values; x and the residual are left unchanged."""
    base, residual, weight = _inputs((3, 2 * 96))
    x = base[:, :96]
    residual = residual[:, :96]
    kept = x.clone(), residual.clone()
    normed, summed = add_rms_norm(x, residual, weight[:96], EPS)
    expected_normed, expected_summed = add_rms_norm_ref(x, residual, weight[:96], EPS)
    assert torch.equal(summed, expected_summed) and rel_rms(normed, expected_normed) < FP32_TOL
    assert torch.equal(x, kept[0]) and torch.equal(residual, kept[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_transformers_llama_rms_norm(dtype):
    """The reference is the model's own norm, bit for bit (the CPU runs the same float32 operations)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, residual, weight = _inputs((3, 1, 576), dtype)
    module = LlamaRMSNorm(576, eps=EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        assert torch.equal(rms_norm_ref(x, weight, EPS), module(x))
        assert torch.equal(add_rms_norm_ref(x, residual, weight, EPS)[0], module(residual + x))


def test_mismatched_inputs_are_refused():
    x, residual, weight = _inputs((3, 64))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:32], EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, residual[:2], weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_add_rms_norm_bf16_gpu(case):
    x, residual, weight = _inputs(CASES[case], torch.bfloat16, "cuda")
    with nan_poisoned_allocations():
        normed, summed = add_rms_norm(x, residual, weight, EPS)
        alone = rms_norm(x, weight, EPS)
    expected_normed, expected_summed = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(summed, expected_summed)
    assert rel_rms(normed, expected_normed) < BF16_TOL
    assert rel_rms(alone, rms_norm_ref(x, weight, EPS)) < BF16_TOL
