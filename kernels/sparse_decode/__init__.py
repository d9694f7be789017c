"""Sparse-decode attention (one decode token over selected cache blocks) and what a decode step runs to choose those
blocks: the block scoring and top-k, ClusterKV's token mask and its compaction into positions, and the upkeep of
Quest's page bounds and SeerAttention's pooled blocks and gate keys.

Triton kernels and their pure-PyTorch references; the public functions run either, as ``retrofit.kernels.backend``
picks (Triton on CUDA, the reference elsewhere).
"""
from .attention import sparse_decode_attention
from .cluster_mask import cluster_take, cluster_token_mask
from .compaction import mask_positions
from .newest_block import pool_newest_block, quest_page_update, seer_gate_key_update
from .reference import (
    block_topk_ref,
    cluster_scores_ref,
    cluster_take_ref,
    cluster_token_mask_ref,
    fixed_bounds,
    fixed_count,
    fixed_positions,
    mask_positions_ref,
    page_bounds,
    pool_blocks,
    pool_newest_block_ref,
    quest_page_scores_ref,
    quest_page_update_ref,
    seer_gate_key_update_ref,
    selected_positions,
    sparse_decode_attention_ref,
    topk_indices_ref,
)
from .scoring import cluster_scores, quest_page_scores
from .topk import block_topk, topk_indices

__all__ = [
    "sparse_decode_attention",
    "sparse_decode_attention_ref",
    "quest_page_scores",
    "quest_page_scores_ref",
    "cluster_scores",
    "cluster_scores_ref",
    "topk_indices",
    "topk_indices_ref",
    "block_topk",
    "block_topk_ref",
    "quest_page_update",
    "quest_page_update_ref",
    "cluster_take",
    "cluster_take_ref",
    "cluster_token_mask",
    "cluster_token_mask_ref",
    "fixed_bounds",
    "fixed_count",
    "fixed_positions",
    "mask_positions",
    "mask_positions_ref",
    "page_bounds",
    "pool_blocks",
    "pool_newest_block",
    "pool_newest_block_ref",
    "seer_gate_key_update",
    "seer_gate_key_update_ref",
    "selected_positions",
]
