"""Block-sparse prefill attention (a prefill chunk over the key blocks selected per query block and head): Triton
kernel and PyTorch reference; the public function runs either, as ``retrofit.kernels.backend`` picks."""
from .attention import sparse_prefill_attention
from .reference import dense_prefill_attention_ref, query_block_count, sparse_prefill_attention_ref

__all__ = ["dense_prefill_attention_ref", "query_block_count", "sparse_prefill_attention",
           "sparse_prefill_attention_ref"]
