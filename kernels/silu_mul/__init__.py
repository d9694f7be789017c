"""The gated MLP's ``silu(gate) * up`` in one launch: Triton kernel and PyTorch reference."""

from .reference import silu_mul_ref
from .silu_mul import silu_mul

__all__ = ["silu_mul", "silu_mul_ref"]
