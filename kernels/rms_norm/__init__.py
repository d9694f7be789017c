"""RMSNorm (optionally fused with the residual add before it): Triton kernel and PyTorch reference."""

from .reference import add_rms_norm_ref, rms_norm_ref
from .rms_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_ref", "rms_norm", "rms_norm_ref"]
