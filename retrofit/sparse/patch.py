"""``sparse_decoding(model, method=..., budget=...)``: the context manager that applies a sparse method.

Inside the context (and only there):

- the session's attention function runs the model's softmax attention (``attention_functions.attention_function``:
  a private name in transformers' registries, masks built exactly as before);
- a forward pre-hook on the model puts a ``SparseCache`` in place of a missing or empty ``DynamicCache`` (this is
  how plain ``model.generate(...)`` and forward calls pick it up).

The attention function runs the original implementation for prefill (dense, bit-identical; block-sparse where a
``sparse_prefill`` is open on the model, or ``prefill=`` names a method) and for layers a method keeps dense; for a single decode token it asks the method which cache blocks to read and runs the shared
sparse-decode kernel on them. On exit everything is undone (also on exceptions).
"""
from __future__ import annotations

import inspect
import weakref
from contextlib import ExitStack, contextmanager
from typing import Any, Iterable, Iterator

import torch
from transformers.cache_utils import DynamicCache

from retrofit.errors import RetrofitError
from retrofit.kernels import use_backend
from retrofit.kernels.sparse_decode import sparse_decode_attention
from retrofit.model_info import attention_layout, restrict_layers
from retrofit.sparse.attention_functions import attention_function, softmax_attention_layers
from retrofit.sparse.cache import SparseCache, SparseLayer
from retrofit.sparse.contract import SparseMethod
from retrofit.sparse.methods.common import all_blocks
from retrofit.sparse.params import KERNELS
from retrofit.sparse.prefill.patch import own_implementation, prefill_or_dense, routed_prefill, sparse_prefill
from retrofit.sparse.registry import build_method
from retrofit.static_cache import static_layers


_ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, SparseSession]" = weakref.WeakKeyDictionary()


def active_session(model: torch.nn.Module) -> "SparseSession | None":
    """The ``sparse_decoding`` session open on ``model`` now, if any (``retrofit.generate`` drives its cache)."""
    return _ACTIVE.get(model)


class SparseSession:
    """What ``sparse_decoding`` yields: the method, the caches it created, and a way to make one explicitly."""

    def __init__(self, model: torch.nn.Module, method: SparseMethod, layers: dict[int, torch.nn.Module], kernel: str):
        self.model = model
        self.method = method
        self.layers = layers
        self.kernel = kernel
        self.backend = KERNELS[kernel]
        self.cache: SparseCache | None = None
        text_config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        self.config = text_config
        self.num_layers = text_config.num_hidden_layers
        self.original_implementation = own_implementation(model)
        self.layout = attention_layout(model)

    def new_cache(self, capacity: int | None = None) -> SparseCache:
        """A fresh ``SparseCache`` for this model and method (pass it as ``past_key_values``); with ``capacity`` a
        static one, every buffer preallocated for that many positions (what ``retrofit.generate`` uses; the layers
        the method leaves are the engine's own, :func:`retrofit.static_cache.static_layers`). The session lets go of
        its previous cache first, so that the two are never held at once."""
        self.cache = None
        base = static_layers(self.model, capacity) if capacity is not None else None
        return SparseCache(self.config, self.method, list(self.layers), self.num_layers, capacity, base)

    def maintain(self, cache: SparseCache, written: int) -> None:
        """Between two decode steps of a static cache (outside any captured step): the method's scheduled upkeep,
        ``written`` tokens being in every layer (ClusterKV clusters the keys it has not clustered yet)."""
        for layer in cache.layers:
            if isinstance(layer, SparseLayer) and layer.is_initialized:
                self.method.maintain(layer, written)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the most recent cache, per component (see ``SparseCache.memory_bytes``)."""
        return self.cache.memory_bytes() if self.cache is not None else {"total": 0}

    # -- the attention function ----------------------------------------------------------------------------------
    def dense(self, module, query, key, value, attention_mask, **kwargs):
        """The model's own attention (a prefill call through an open ``sparse_prefill``)."""
        return prefill_or_dense(self.model, self.original_implementation, module, query, key, value, attention_mask,
                                **kwargs)

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """Attention interface: query [B, Hq, T, D], key/value [B, Hkv, N, D] -> ([B, T, Hq, D], None)."""
        if self.backend == "auto":
            return self._attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        with use_backend(self.backend):
            return self._attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

    def _attention(self, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
        layer = self._layer_for(module, key)
        if layer is None:
            return self.dense(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer.observe_padding(attention_mask)
        start, end = layer.new_start, layer.length
        if query.shape[2] > 1:
            out = self.dense(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            self.method.prepare(layer, start, end)
            return out
        return self._decode(layer, query[:, :, 0, :].contiguous(), scaling)[:, None, :, :], None

    def decode(self, layer: SparseLayer, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """One decode token's attention over ``layer``, the token written already (the engine's fused decode
        layers write it with ``SparseLayer.write_rotated_next``): q [B, Hq, D] rotated -> [B, Hq, D], what the
        attention function gives for that token."""
        if self.backend == "auto":
            return self._decode(layer, q, scaling)
        with use_backend(self.backend):
            return self._decode(layer, q, scaling)

    def _decode(self, layer: SparseLayer, q: torch.Tensor, scaling: float | None) -> torch.Tensor:
        if not layer.static:  # upkeep over the tokens before this step's (a static cache's runs between steps)
            self.method.maintain(layer, layer.length - 1)
        self.method.prepare_step(layer)
        selection = self.method.select(layer, q)
        if selection is None:  # the method keeps this layer dense: every valid position, through the same kernel
            selection = all_blocks(layer)
        else:
            layer.sparse_steps += 1
        return sparse_decode_attention(q, layer.keys, layer.values, selection.indices, selection.counts,
                                       layer.kv_start, layer.kv_end, block_size=selection.block_size, scale=scaling,
                                       softcap=self.layout.layers[layer.layer_idx].softcap)

    def _layer_for(self, module, key) -> SparseLayer | None:
        cache = self.cache
        idx = getattr(module, "layer_idx", None)
        if cache is None or idx is None or idx >= len(cache.layers):
            return None
        layer = cache.layers[idx]
        if not isinstance(layer, SparseLayer) or layer.returned_keys is not key:
            return None
        return layer

    # -- cache injection -----------------------------------------------------------------------------------------
    def inject_cache(self, module, args, kwargs):
        name = next((n for n in ("cache", "past_key_values") if n in kwargs), None)
        cache = kwargs.get(name) if name else None
        if isinstance(cache, SparseCache):
            self.cache = cache
            return None
        if kwargs.get("use_cache") is False or (cache is None and not getattr(self.config, "use_cache", True)
                                                 and kwargs.get("use_cache") is None):
            return None
        if cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0):
            self.cache = self.new_cache()
            kwargs[name or self._cache_argument(module)] = self.cache
            return args, kwargs
        return None

    @staticmethod
    def _cache_argument(module) -> str:
        parameters = inspect.signature(module.forward).parameters
        return "cache" if "cache" in parameters else "past_key_values"


@contextmanager
def sparse_decoding(
    model: torch.nn.Module, method: str = "quest", budget: int | str = 2048, kernel: str = "auto",
    layers: Iterable[int] | str | None = None, prefill: str | None = None, prefill_args: dict[str, Any] | None = None,
    **params: Any
) -> Iterator[SparseSession]:
    """Apply a training-free sparse decoding method to ``model`` inside a ``with`` block.

    >>> with sparse_decoding(model, method="quest", budget=1024, page_size=16) as session:
    ...     out = model.generate(**inputs, max_new_tokens=64)
    ...     print(session.memory_bytes())

    ``method``: a registered name (``retrofit.sparse.METHODS.names()``); ``budget``: tokens read per kv head per
    decode step; ``params``: the method's fields (strings from the CLI are converted); ``kernel``: "auto" (Triton on
    CUDA, the PyTorch reference on CPU), "triton" or "reference"; ``layers``: restrict the method to these layer
    indices (default: every softmax-attention layer; the others stay dense); ``prefill``: a sparse prefill method
    (``retrofit.sparse.prefill``, e.g. "xattention") run on the prompt in the same session, with ``prefill_args``
    (its ``threshold``, ``min_length``, ...). The model is restored exactly on exit.
    """
    if kernel not in KERNELS:
        raise RetrofitError(f"kernel={kernel!r} is invalid: choose from {', '.join(KERNELS)}")
    if model in _ACTIVE:
        raise RetrofitError("sparse_decoding is already open on this model: close it before opening another")
    if prefill_args and prefill is None:
        raise RetrofitError("prefill_args needs prefill=METHOD (a sparse prefill method, e.g. 'xattention')")
    sparse_method = build_method(method, budget, **params)
    attention_layout(model).require_interface("sparse decoding")
    attention = softmax_attention_layers(model)
    if not attention:
        raise RetrofitError(f"{type(model).__name__} has no softmax-attention layer whose cache grows with the context "
                            f"to apply {method!r} to (its sliding-window layers are bounded already)")
    if layers is not None:
        chosen = restrict_layers(layers, attention, f"softmax-attention layers of {type(model).__name__} whose cache "
                                 "grows with the context")
        attention = {i: attention[i] for i in chosen}
    session = SparseSession(model, sparse_method, attention, kernel)
    sparse_method.bind(session.config)  # settings that follow the model (Quest's page size, random Seer gates)
    with ExitStack() as undo:
        undo.enter_context(routed_prefill(model))
        if prefill is not None:
            undo.enter_context(sparse_prefill(model, prefill, **{"kernel": kernel, **(prefill_args or {})}))
        _ACTIVE[model] = session
        undo.callback(_ACTIVE.pop, model, None)
        undo.enter_context(attention_function(model, session.attention, "sparse"))
        hook = model.register_forward_pre_hook(session.inject_cache, with_kwargs=True)
        undo.callback(hook.remove)
        undo.callback(setattr, session, "cache", None)
        yield session
