"""``silu(gate) * up`` in Triton: the gated MLP's activation in one launch (instead of one for SiLU and one for the
product). float32 math, SiLU rounded to the inputs' dtype before the product as the model does; semantics in
``reference.py`` beside this file. Inference only; no host synchronisation (CUDA-graph capturable)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    gate = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=inside, other=0.0)
    activated = (gate / (1.0 + tl.exp(-gate))).to(up_ptr.dtype.element_ty)
    out = activated.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Triton path of :func:`silu_mul`."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must share shape and dtype: {tuple(gate.shape)} {gate.dtype} vs "
                         f"{tuple(up.shape)} {up.dtype}")
    gate = gate if gate.is_contiguous() else gate.contiguous()
    up = up if up.is_contiguous() else up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    _silu_mul_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate, up [..., I]`` (one shape and dtype) -> ``[..., I]``. Triton or
    ``reference.silu_mul_ref``, as ``retrofit.kernels.backend`` picks for the device."""
    return implementation("silu_mul", gate.device)(gate, up)
