"""retrofit's Triton kernels, importable as ``retrofit.kernels``.

Each op lives in its own folder with a pure-PyTorch reference beside the fast path; both are exported here.
This package imports nothing from the rest of ``retrofit`` (its modules import one another relatively).
``backend.py`` decides, for every op, whether its Triton kernel or its PyTorch path runs (``use_backend`` /
``RETROFIT_BACKEND``; default: Triton on CUDA, PyTorch elsewhere); ``device.py`` holds the device facts (SM count)
that the launch heuristics of several folders read.

- ``chunk_gated_delta_rule`` / ``chunk_kda``: chunked form (training, prefill), differentiable.
- ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``: recurrent form (decode), inference only;
  ``RecurrentDecodeGraph`` captures one decode step in a CUDA graph; ``delta_rule_decode_step``: a GDN or KDA
  layer's decode token after its conv (q/k norms, gates and the recurrence in one launch), ``sigmoid_gated_rms_norm``
  its output norm; ``l2_normalize_ref`` / ``log_decay_ref``: the norms' and gates' math the layers share.
- ``causal_conv1d`` (prefill, differentiable) / ``causal_conv1d_update`` (decode): short causal depthwise conv.
- ``naive_*``: the pure-PyTorch references the kernels are tested against.
- ``sparse_decode``: one decode token's attention over selected cache blocks, block scoring, top-k.
- ``sparse_prefill_attention``: a prefill chunk's causal attention over the key blocks selected per query block and
  head (block-sparse prefill), ``sparse_prefill_attention_ref`` its reference; ``sparse_prefill.antidiagonal_block_mass``
  the fused estimate XAttention chooses those blocks by.
- ``rms_norm`` / ``add_rms_norm`` (RMSNorm, optionally after the residual add), ``silu_mul`` (the gated MLP's
  activation), ``rotary_qk`` / ``rotary_qk_into_cache`` (a decode token's rotary embedding, optionally writing k and v
  into a static cache): the fused pieces of a decoder layer's decode step, inference only.
"""

from ._checkout_root import installed_kernels_took_the_name

# imported as the top-level `kernels` from a checkout's root, Hugging Face's package takes the name (_checkout_root.py)
if not installed_kernels_took_the_name(__name__):
    from .backend import backend_for, use_backend
    from .conv import causal_conv1d, causal_conv1d_update, naive_causal_conv1d, naive_causal_conv1d_update
    from .gated_delta_rule.chunk import chunk_gated_delta_rule
    from .delta_common.reference import delta_rule_decode_step_ref, l2_normalize_ref, log_decay_ref
    from .gated_delta_rule.decode_graph import RecurrentDecodeGraph
    from .gated_delta_rule.decode_step import delta_rule_decode_step
    from .gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
    from .gated_delta_rule.reference import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
    from .kda.chunk import chunk_kda
    from .kda.fused_recurrent import fused_recurrent_kda
    from .kda.reference import naive_chunk_kda, naive_recurrent_kda
    from .rms_norm import (
        add_rms_norm,
        add_rms_norm_ref,
        gated_rms_norm_ref,
        rms_norm,
        rms_norm_ref,
        sigmoid_gated_rms_norm,
        sigmoid_gated_rms_norm_ref,
    )
    from .rotary import rotary_qk, rotary_qk_into_cache, rotary_qk_into_cache_ref, rotary_qk_ref
    from .silu_mul import silu_mul, silu_mul_ref
    from .sparse_prefill import sparse_prefill_attention, sparse_prefill_attention_ref

__all__ = [
    "RecurrentDecodeGraph",
    "add_rms_norm",
    "add_rms_norm_ref",
    "backend_for",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "delta_rule_decode_step",
    "delta_rule_decode_step_ref",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "gated_rms_norm_ref",
    "l2_normalize_ref",
    "log_decay_ref",
    "naive_causal_conv1d",
    "naive_causal_conv1d_update",
    "naive_chunk_gated_delta_rule",
    "naive_chunk_kda",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_kda",
    "rms_norm",
    "rms_norm_ref",
    "rotary_qk",
    "rotary_qk_into_cache",
    "rotary_qk_into_cache_ref",
    "rotary_qk_ref",
    "sigmoid_gated_rms_norm",
    "sigmoid_gated_rms_norm_ref",
    "silu_mul",
    "silu_mul_ref",
    "sparse_prefill_attention",
    "sparse_prefill_attention_ref",
    "use_backend",
]
