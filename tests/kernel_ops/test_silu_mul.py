"""The gated MLP's ``silu(gate) * up`` Triton kernel against its PyTorch reference (kernels/silu_mul/reference.py),
and the reference against transformers' ``LlamaMLP`` activation.

CPU: Triton interpreter, float32. FP32_TOL = 1e-6 relative RMS: the same float32 math, with the exponential of the
interpreter (numpy) against PyTorch's (observed differences ~1e-7); a wrong element or a missing factor is of order 1.
GPU (marked ``gpu``): bfloat16. BF16_TOL = 4e-3, half a bf16 ulp in RMS: both round SiLU and the product to bf16 at
the same points; only elements whose float32 exponential differs in the last bits round differently, by one ulp.
Every buffer the kernel allocates is NaN-poisoned, so unwritten memory fails the comparison.
"""
from __future__ import annotations

import pytest
import torch

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels import silu_mul, silu_mul_ref

FP32_TOL = 1e-6  # see module docstring
BF16_TOL = 4e-3  # see module docstring

# [B, I] rows of the MLP's intermediate size: batch 1 and 3, one block, a partial block, several blocks
CASES = {"B1-I100": (1, 100), "B3-I1536-smollm2": (3, 1536), "B1-I14336-llama3": (1, 14336), "B3x1-I1000": (3, 1, 1000)}


def _inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(shape, generator=gen) * 4
    up = torch.randn(shape, generator=gen)
    return gate.to(device, dtype), up.to(device, dtype)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_silu_mul_matches_reference_fp32(case):
    gate, up = _inputs(CASES[case])
    with nan_poisoned_allocations():
        out = silu_mul(gate, up)
    assert out.shape == gate.shape
    assert rel_rms(out, silu_mul_ref(gate, up)) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_llama_mlp_activation(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=100, hidden_act="silu"))
    gate, up = _inputs((3, 100), dtype)
    assert torch.equal(silu_mul_ref(gate, up), mlp.act_fn(gate) * up)


def test_mismatched_inputs_are_refused():
    gate, up = _inputs((3, 100))
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul(gate, up[:, :50])


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_silu_mul_bf16_gpu(case):
    gate, up = _inputs(CASES[case], torch.bfloat16, "cuda")
    with nan_poisoned_allocations():
        out = silu_mul(gate, up)
    assert rel_rms(out, silu_mul_ref(gate, up)) < BF16_TOL
