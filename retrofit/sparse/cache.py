"""The transformers ``Cache`` used inside ``sparse_decoding``: full (or, for StreamingLLM, evicted) KV per layer,
preallocated and grown geometrically, plus each method's metadata in ``layer.meta``.

Layers that are not softmax attention (linear-attention, sliding-window) keep the layer types transformers'
``DynamicCache(config=...)`` gives them; only the softmax layers become ``SparseLayer``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer

from retrofit.errors import RetrofitError

if TYPE_CHECKING:
    from retrofit.sparse.base import SparseMethod

_GROW_MIN = 256


class SparseLayer(CacheLayerMixin):
    """One softmax-attention layer's cache.

    ``keys``/``values`` [B, Hkv, capacity, D] buffers; positions ``[0, length)`` are written; row ``b``'s valid
    positions are ``kv_start[b] <= pos < kv_end[b]`` ([B] int32; left padding lies before ``kv_start``).
    ``seen`` counts every token ever appended (what transformers calls the sequence length).
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, layer_idx: int, method: "SparseMethod", kernel: str = "auto"):
        super().__init__()
        self.layer_idx = layer_idx
        self.method = method
        self.kernel = kernel
        self.length = 0
        self.seen = 0
        self.kv_start: torch.Tensor | None = None
        self.kv_end: torch.Tensor | None = None
        self.meta: dict[str, Any] = {}
        self.padding_known = False
        self.new_start = 0
        self.returned_keys: torch.Tensor | None = None
        self.sparse_steps = 0  # decode steps that ran the sparse kernel (not the dense fallback)

    # -- storage -------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty(B, H, 0, D)
        self.values = value_states.new_empty(B, H, 0, value_states.shape[-1])
        self.kv_start = torch.zeros(B, dtype=torch.int32, device=self.device)
        self.kv_end = torch.zeros(B, dtype=torch.int32, device=self.device)
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def use_triton(self, tensor: torch.Tensor) -> bool:
        """Whether this layer's per-step kernels run in Triton (CUDA or forced) or as the PyTorch reference."""
        return self.kernel == "triton" or (self.kernel == "auto" and tensor.is_cuda)

    def reserve(self, needed: int, limit: int | None = None) -> None:
        """Grow the buffers (geometrically, never past ``limit``) to hold at least ``needed`` positions."""
        if needed <= self.capacity:
            return
        new_capacity = max(needed, 2 * self.capacity, _GROW_MIN)
        if limit is not None:
            new_capacity = max(needed, min(new_capacity, limit))
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append keys/values [B, Hkv, T, D] at the common write position ``length``."""
        T = keys.shape[2]
        self.reserve(self.length + T)
        self.keys[:, :, self.length : self.length + T] = keys
        self.values[:, :, self.length : self.length + T] = values
        self.length += T
        self.kv_end.fill_(self.length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new keys/values [B, Hkv, T, D]; return what dense attention over the cache needs."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.method.evicts and self.padding_known and key_states.shape[2] > 1:
            raise RetrofitError(
                f"sparse method {self.method.name!r} evicts tokens: feed the prompt in one forward call (no chunked prefill)")
        first = self.seen == 0
        self.new_start = self.length
        self.method.append(self, key_states, value_states)
        self.seen += key_states.shape[2]
        if self.method.evicts:
            keys, values = (key_states, value_states) if first else (self.keys[:, :, : self.length], self.values[:, :, : self.length])
        else:
            keys, values = self.keys[:, :, : self.length], self.values[:, :, : self.length]
        self.returned_keys = keys
        return keys, values

    # -- transformers Cache API ----------------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        # transformers < 5.2x passes cache_position [T] here, newer versions the query length
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.layer_idx, self.method, self.kernel)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RetrofitError("sparse decoding does not support beam search (num_beams > 1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RetrofitError("sparse decoding does not support num_return_sequences > 1 with a filled cache")

    def crop(self, tokens_to_remove: int) -> None:
        raise RetrofitError("sparse decoding caches cannot be cropped (assisted/speculative decoding is unsupported)")

    def offload(self):  # noqa: D102 - offloading is not supported: keep the buffers where they are
        pass

    def prefetch(self):  # noqa: D102
        pass

    # -- padding -------------------------------------------------------------------------------------------------
    def observe_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Record left padding from the prefill mask (4D bool/additive [B, 1, Q, K] or 2D [B, K]); once."""
        if self.padding_known:
            return
        self.padding_known = True
        if attention_mask is None:
            return
        if attention_mask.ndim == 4:
            last_row = attention_mask[:, 0, -1, :]
            valid = last_row if last_row.dtype == torch.bool else last_row == 0
        elif attention_mask.ndim == 2:
            valid = attention_mask.bool()
        else:
            return
        valid = valid[:, : self.length]
        if valid.shape[0] == 1 and self.kv_start.shape[0] > 1:
            valid = valid.expand(self.kv_start.shape[0], -1)
        first = valid.int().argmax(-1)
        contiguous = valid.sum(-1) == valid.shape[-1] - first
        if not bool(contiguous.all()):
            raise RetrofitError("sparse decoding needs left padding (tokenizer.padding_side = 'left')")
        self.kv_start.copy_(first.to(torch.int32))

    # -- accounting ----------------------------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this layer holds, per component: "kv" (allocated key/value buffers) plus the method's metadata."""
        if not self.is_initialized:
            return {"kv": 0}
        parts = {"kv": self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()}
        for name, size in self.method.metadata_bytes(self).items():
            parts[name] = parts.get(name, 0) + size
        return parts


class SparseCache(DynamicCache):
    """A ``DynamicCache`` whose softmax-attention layers are ``SparseLayer`` objects of one method.

    Create it through ``sparse_decoding(...)`` (it is injected into ``generate``/forward calls automatically) or
    ``session.new_cache()`` and pass it as ``past_key_values``.
    """

    def __init__(self, config, method: "SparseMethod", sparse_layers: list[int], num_layers: int, kernel: str = "auto"):
        super().__init__(config=config)
        if len(self.layers) < num_layers or self.layer_class_to_replicate is not None:
            self.layers = [DynamicLayer() for _ in range(num_layers)]
            self.layer_class_to_replicate = None
        for idx in sparse_layers:
            self.layers[idx] = SparseLayer(idx, method, kernel)
        self.method = method
        self.sparse_layers = list(sparse_layers)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes really held, per component, summed over layers ("kv", "metadata", "index", ...; plus "total")."""
        totals: dict[str, int] = {}
        for layer in self.layers:
            if isinstance(layer, SparseLayer):
                parts = layer.memory_bytes()
            elif getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
                parts = {"kv": layer.keys.numel() * layer.keys.element_size()
                         + layer.values.numel() * layer.values.element_size()}
            else:
                parts = {}
            for name, size in parts.items():
                totals[name] = totals.get(name, 0) + size
        totals["total"] = sum(totals.values())
        return totals
