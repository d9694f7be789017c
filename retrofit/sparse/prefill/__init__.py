"""Training-free block-sparse prefill: XAttention's antidiagonal scores or MInference's vertical-slash estimate choose
the key blocks each query block of each head computes; the kernel skips the rest.

``with sparse_prefill(model, method="xattention", threshold=0.9): retrofit.generate(...)``.

``blocks.py`` (the block grid of a call and the choice every method shares), ``methods.py`` (the methods and their
registry), ``patch.py`` (the context manager, the record of blocks computed).
"""
from retrofit.sparse.prefill.blocks import BlockGrid, block_lists, choose_blocks, left_padding
from retrofit.sparse.prefill.methods import (DEFAULT_MIN_LENGTH, MIN_LENGTH_HELP, PREFILL_METHODS, PrefillMethod,
                                             build_prefill_method)
from retrofit.sparse.prefill.patch import (PrefillCall, SparsePrefill, active_prefill, blocks_computed,
                                           own_implementation, prefill_layers, prefill_or_dense, prompt_continues,
                                           routed_prefill, share_computed, sparse_prefill)

__all__ = ["BlockGrid", "DEFAULT_MIN_LENGTH", "MIN_LENGTH_HELP", "PREFILL_METHODS", "PrefillCall", "PrefillMethod",
           "SparsePrefill", "active_prefill", "block_lists", "blocks_computed", "build_prefill_method", "choose_blocks",
           "left_padding", "own_implementation", "prefill_layers", "prefill_or_dense", "prompt_continues",
           "routed_prefill", "share_computed", "sparse_prefill"]
