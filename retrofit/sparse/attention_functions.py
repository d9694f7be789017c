"""Scoped attention functions, as sparse decoding and Seer gate training import them: the module lives in
:mod:`retrofit.attention_functions` (conversion's retrieval probe uses it too, and conversion may not import sparse)."""
from retrofit.attention_functions import (attention_function, dense_attention, implementation_of, mask_function_of,
                                          softmax_attention_layers)

__all__ = ["attention_function", "dense_attention", "implementation_of", "mask_function_of", "softmax_attention_layers"]
