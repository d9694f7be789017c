"""Gated DeltaNet (scalar per-head decay): chunked Triton kernels and pure-PyTorch references."""
from .chunk import chunk_gated_delta_rule
from .reference import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule", "naive_chunk_gated_delta_rule"]
