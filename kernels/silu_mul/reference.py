"""Pure-PyTorch ``silu(gate) * up``, the gated MLP's activation: the specification the Triton kernel is tested
against. As transformers' ``LlamaMLP`` computes it: ``act_fn(gate)`` rounded to the inputs' dtype, then the product."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] (one shape and dtype) -> silu(gate) * up [..., I]."""
    return F.silu(gate) * up
