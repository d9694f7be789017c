"""Block-sparse prefill attention (a prefill chunk over the key blocks selected per query block and head): Triton
kernel and PyTorch reference, and XAttention's antidiagonal block mass (the estimate that chooses the blocks): fused
kernel and reference; each public function runs either, as ``retrofit.kernels.backend`` picks."""
from .attention import sparse_prefill_attention
from .estimate import antidiagonal_block_mass
from .reference import (antidiagonal_block_mass_ref, dense_prefill_attention_ref, query_block_count,
                        sparse_prefill_attention_ref)

__all__ = ["antidiagonal_block_mass", "antidiagonal_block_mass_ref", "dense_prefill_attention_ref",
           "query_block_count", "sparse_prefill_attention", "sparse_prefill_attention_ref"]
