"""RMSNorm (optionally fused with the residual add before it) and the delta-rule layers' sigmoid-gated per-head
output norm: Triton kernels and PyTorch references."""

from .gated import sigmoid_gated_rms_norm
from .reference import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref, sigmoid_gated_rms_norm_ref
from .rms_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "add_rms_norm_ref", "gated_rms_norm_ref", "rms_norm", "rms_norm_ref",
           "sigmoid_gated_rms_norm", "sigmoid_gated_rms_norm_ref"]
