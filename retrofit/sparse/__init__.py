"""Training-free sparse decoding: StreamingLLM, Quest, ClusterKV, RetrievalAttention (faiss), SeerAttention.

``with sparse_decoding(model, method="quest", budget=2048): model.generate(...)``.
"""
from retrofit.sparse.base import METHODS, Selection, SparseMethod, build_method, parse_sparse_args
from retrofit.sparse.cache import SparseCache, SparseLayer
from retrofit.sparse.patch import SparseSession, softmax_attention_layers, sparse_decoding
from retrofit.sparse import methods as _methods  # noqa: F401  (registers the built-in methods)

__all__ = [
    "sparse_decoding",
    "parse_sparse_args",
    "build_method",
    "METHODS",
    "SparseMethod",
    "Selection",
    "SparseCache",
    "SparseLayer",
    "SparseSession",
    "softmax_attention_layers",
]
