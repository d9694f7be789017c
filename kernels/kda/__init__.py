"""Kimi Delta Attention (per-channel decay): chunked Triton kernels and pure-PyTorch references."""
from .chunk import chunk_kda
from .reference import naive_chunk_kda, naive_recurrent_kda

__all__ = ["chunk_kda", "naive_recurrent_kda", "naive_chunk_kda"]
