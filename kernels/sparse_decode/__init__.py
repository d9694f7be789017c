"""Sparse-decode attention (one decode token over selected cache blocks), the per-step block scoring and top-k.

Triton kernels and their pure-PyTorch references; the public functions run either, as ``retrofit.kernels.backend``
picks (Triton on CUDA, the reference elsewhere).
"""
from .attention import sparse_decode_attention
from .reference import (
    cluster_scores_ref,
    quest_page_scores_ref,
    selected_positions,
    sparse_decode_attention_ref,
    topk_indices_ref,
)
from .scoring import cluster_scores, quest_page_scores
from .topk import topk_indices

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
