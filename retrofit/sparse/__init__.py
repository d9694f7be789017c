"""Training-free sparse decoding: StreamingLLM, Quest, ClusterKV, RetrievalAttention (faiss), SeerAttention; and
training-free block-sparse prefill (XAttention, MInference's vertical-slash: ``prefill/``).

``with sparse_decoding(model, method="quest", budget=2048): model.generate(...)``;
``with sparse_prefill(model, method="xattention", threshold=0.9): ...`` (or ``sparse_decoding(..., prefill=...)``).

``contract.py`` (what a method is), ``registry.py`` (methods by name), ``params.py`` (``--sparse-arg`` values),
``cache.py`` (the cache and the layer API methods use), ``attention_functions.py`` (scoped attention functions),
``patch.py`` (the context manager), ``methods/`` (one small file per method; Seer's folder holds its gate training),
``prefill/`` (sparse prefill: its methods, the blocks they choose, its context manager).
"""
from retrofit.sparse.attention_functions import softmax_attention_layers
from retrofit.sparse.cache import SparseCache, SparseLayer
from retrofit.sparse.contract import Selection, SparseMethod
from retrofit.sparse.params import parse_sparse_args
from retrofit.sparse.patch import SparseSession, sparse_decoding
from retrofit.sparse.prefill import PREFILL_METHODS, SparsePrefill, blocks_computed, sparse_prefill
from retrofit.sparse.registry import METHODS, build_method
from retrofit.sparse import methods as _methods  # noqa: F401  (registers the built-in methods)

__all__ = [
    "sparse_decoding",
    "sparse_prefill",
    "PREFILL_METHODS",
    "SparsePrefill",
    "blocks_computed",
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
