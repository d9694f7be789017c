"""RMSNorm in Triton, optionally fused with the residual add before it: one program per row, one launch.

Semantics (float32 statistics, rounding to the input dtype before the weight, as transformers' ``LlamaRMSNorm``):
``reference.py`` beside this file. Inference only (no backward); no host synchronisation, so a CUDA graph can hold it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr, H, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * H + cols, mask=inside, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded, as the model adds
        tl.store(summed_ptr + row * H + cols, x, mask=inside)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / H
    normed = (x32 * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=inside, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * H + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"weight must have shape ({H},), got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs "
                         f"{tuple(x.shape)} {x.dtype}")
    x = x if x.is_contiguous() else x.contiguous()
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    summed = None
    if residual is not None:
        residual = residual if residual.is_contiguous() else residual.contiguous()
        summed = torch.empty_like(x)
    rows = x.numel() // max(H, 1)
    block_h = triton.next_power_of_2(H)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out,
                              summed if summed is not None else out, H, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
                              num_warps=4 if block_h <= 2048 else 8)
    return out, summed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton path of :func:`rms_norm`."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of :func:`add_rms_norm`."""
    return _launch(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]`` -> ``[..., H]`` (dtype: promoted of weight and x), float32
    statistics as transformers' ``LlamaRMSNorm``. Triton or ``reference.rms_norm_ref``, as the backend picks."""
    return implementation("rms_norm", x.device)(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's ``summed = residual + x; normed = rms_norm(summed)`` in one pass: ``x, residual [..., H]``
    (one shape and dtype), ``weight [H]`` -> ``(normed [..., H], summed [..., H])``. Triton or
    ``reference.add_rms_norm_ref``, as the backend picks."""
    return implementation("add_rms_norm", x.device)(x, residual, weight, eps)
