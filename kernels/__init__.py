"""retrofit's Triton kernels, importable as ``retrofit.kernels``.

Each op lives in its own folder with a pure-PyTorch reference beside the fast path; both are exported here.
This package imports nothing from the rest of ``retrofit`` (its modules import one another relatively).
``backend.py`` decides, for every op, whether its Triton kernel or its PyTorch path runs (``use_backend`` /
``RETROFIT_BACKEND``; default: Triton on CUDA, PyTorch elsewhere); ``device.py`` holds the device facts (SM count)
that the launch heuristics of several folders read.

- ``chunk_gated_delta_rule`` / ``chunk_kda``: chunked form (training, prefill), differentiable.
- ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda``: recurrent form (decode), inference only;
  ``RecurrentDecodeGraph`` captures one decode step in a CUDA graph.
- ``causal_conv1d`` (prefill, differentiable) / ``causal_conv1d_update`` (decode): short causal depthwise conv.
- ``naive_*``: the pure-PyTorch references the kernels are tested against.
- ``sparse_decode``: one decode token's attention over selected cache blocks, block scoring, top-k.
"""

from .backend import backend_for, use_backend
from .conv import causal_conv1d, causal_conv1d_update, naive_causal_conv1d, naive_causal_conv1d_update
from .gated_delta_rule.chunk import chunk_gated_delta_rule
from .gated_delta_rule.decode_graph import RecurrentDecodeGraph
from .gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from .gated_delta_rule.reference import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from .kda.chunk import chunk_kda
from .kda.fused_recurrent import fused_recurrent_kda
from .kda.reference import naive_chunk_kda, naive_recurrent_kda

__all__ = [
    "RecurrentDecodeGraph",
    "backend_for",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "naive_causal_conv1d",
    "naive_causal_conv1d_update",
    "naive_chunk_gated_delta_rule",
    "naive_chunk_kda",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_kda",
    "use_backend",
]
