"""Sparse-decode attention (one decode token over selected cache blocks), the per-step block scoring and top-k.

Triton kernels and their pure-PyTorch references; ``dispatch`` picks the kernel on CUDA and the reference on CPU.
"""
from retrofit.kernels.sparse_decode.attention import sparse_decode_attention
from retrofit.kernels.sparse_decode.reference import (
    cluster_scores_ref,
    quest_page_scores_ref,
    selected_positions,
    sparse_decode_attention_ref,
    topk_indices_ref,
)
from retrofit.kernels.sparse_decode.scoring import cluster_scores, quest_page_scores
from retrofit.kernels.sparse_decode.topk import topk_indices

__all__ = [
    "sparse_decode_attention",
    "sparse_decode_attention_ref",
    "quest_page_scores",
    "quest_page_scores_ref",
    "cluster_scores",
    "cluster_scores_ref",
    "topk_indices",
    "topk_indices_ref",
    "selected_positions",
]
