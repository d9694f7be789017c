"""The transformers ``Cache`` used inside ``sparse_decoding``: full (or, for StreamingLLM, evicted) KV per layer,
preallocated (static, for ``retrofit.generate``) or grown geometrically (``model.generate``), plus each method's
metadata in ``layer.meta``.

Layers that are not softmax attention with an unbounded cache (linear-attention, sliding-window) keep the layer types
transformers' ``DynamicCache(config=...)`` gives them, or in a static cache the engine's
(:func:`retrofit.static_cache.static_layers`); only the unbounded softmax layers become ``SparseLayer``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, StaticCache

from retrofit.errors import RetrofitError
from retrofit.kernels import rotary_qk_into_cache

if TYPE_CHECKING:
    from retrofit.sparse.contract import SparseMethod

_GROW_MIN = 256


class SparseLayer(CacheLayerMixin):
    """One softmax-attention layer's cache.

    What a method reads: ``keys``/``values`` [B, Hkv, capacity, D] buffers; row ``b``'s valid positions
    ``kv_start[b] <= pos < kv_end[b]`` ([B] int32 device tensors; left padding lies before ``kv_start``); ``meta``,
    the method's own metadata (its to change, in place once allocated). The buffers change only through
    :meth:`write` (a prefill chunk, at the host-known position ``length``), :meth:`write_next` (one decode token per
    row at the device position ``write_pos``; :meth:`write_rotated_next` the same with the token's rotation, for
    the engine's fused decode layers), :meth:`write_rows` (one token per row at per-row positions) and
    :meth:`compact` (keep chosen positions only).

    With ``capacity`` (a static cache, :meth:`SparseSession.new_cache`), the buffers are allocated once at that size
    and a decode step touches device tensors only: ``write_pos``, ``kv_end`` and the metadata advance in place, so the
    step can be captured as a CUDA graph. The host counters (``length``, ``seen``) are then exact up to the first
    decode step and advance with each eager step (what transformers' ``get_seq_length`` reads), but a replayed graph
    does not run Python: code that runs inside a captured step reads only device tensors. Without ``capacity`` (plain
    ``model.generate``), the buffers grow geometrically between steps.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, layer_idx: int, method: "SparseMethod", capacity: int | None = None):
        # CacheLayerMixin.__init__ only assigns keys/values (read-only here) and is_initialized.
        self.is_initialized = False
        self.layer_idx = layer_idx
        self.method = method
        self.static_capacity = capacity
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._length = 0
        self._kv_start: torch.Tensor | None = None
        self._kv_end: torch.Tensor | None = None
        self._write_pos: torch.Tensor | None = None
        self.kv_start_host: list[int] | None = None
        self.seen = 0
        self.meta: dict[str, Any] = {}
        self.padding_known = False
        self.evicted = False
        self.new_start = 0
        self.returned_keys: torch.Tensor | None = None
        self.sparse_steps = 0  # decode steps that ran the sparse kernel (not the dense fallback)

    # -- what methods read ---------------------------------------------------------------------------------------
    keys = property(lambda self: self._keys, doc="[B, Hkv, capacity, D] key buffer.")
    values = property(lambda self: self._values, doc="[B, Hkv, capacity, D] value buffer.")
    length = property(lambda self: self._length, doc="Positions [0, length) of the buffers are written (host count).")
    kv_start = property(lambda self: self._kv_start, doc="[B] int32: first valid position of each row.")
    kv_end = property(lambda self: self._kv_end, doc="[B] int32: one past the last valid position of each row.")
    write_pos = property(lambda self: self._write_pos, doc="[1] long: where the next decode token is written.")

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[2]

    @property
    def static(self) -> bool:
        return self.static_capacity is not None

    # -- storage -------------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        size = self.static_capacity or 0
        self._keys = key_states.new_zeros(B, H, size, D)
        self._values = value_states.new_zeros(B, H, size, value_states.shape[-1])
        self._kv_start = torch.zeros(B, dtype=torch.int32, device=self.device)
        self._kv_end = torch.zeros(B, dtype=torch.int32, device=self.device)
        self._write_pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.kv_start_host = [0] * B
        self.is_initialized = True

    def _reserve(self, needed: int, limit: int | None = None) -> None:
        """Grow the buffers (geometrically, never past ``limit``) to hold at least ``needed`` positions."""
        if needed <= self.capacity:
            return
        if self.static:
            raise RetrofitError(f"the static cache holds {self.capacity} positions; {needed} were asked for")
        new_capacity = max(needed, 2 * self.capacity, _GROW_MIN)
        if limit is not None:
            new_capacity = max(needed, min(new_capacity, limit))
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new_capacity, old.shape[3])
            grown[:, :, : self._length] = old[:, :, : self._length]
            setattr(self, name, grown)

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append keys/values [B, Hkv, T, D] at the common write position ``length`` (host-known: prefill)."""
        T = keys.shape[2]
        self._reserve(self._length + T)
        self._keys[:, :, self._length : self._length + T] = keys
        self._values[:, :, self._length : self._length + T] = values
        self._length += T
        self._kv_end.fill_(self._length)
        self._write_pos.fill_(self._length)

    def write_next(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one decode token per row, keys/values [B, Hkv, 1, D], at the device position ``write_pos`` (the
        same for every row); ``write_pos`` and ``kv_end`` advance on the device."""
        self._reserve(self._length + 1)
        self._keys.index_copy_(2, self._write_pos, keys)
        self._values.index_copy_(2, self._write_pos, values)
        self._write_pos.add_(1)
        self._kv_end.add_(1)
        self._length += 1

    def fusable_decode_write(self) -> bool:
        """Whether a decode token may be rotated and written by :meth:`write_rotated_next`: a static layer, not
        evicted, whose method stores decode tokens the default way (``SparseMethod.plain_decode_write``)."""
        return self.static and self.is_initialized and not self.evicted and self.method.plain_decode_write()

    def decode_counters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``write_pos`` [1] long, ``kv_end`` [B] int32): the device counters one decode token advances by one,
        which :meth:`write_rotated_next` expects advanced already (the engine's fused step adds one to the counters
        of all its layers in one ``_foreach_add_`` per dtype)."""
        return self._write_pos, self._kv_end

    def write_rotated_next(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
        """One decode token per row, its :meth:`decode_counters` advanced already: rotate ``q [B, Hq, D]`` and
        ``k [B, Hkv, D]`` by ``cos, sin`` (``[B, 1, D]``, the model's position embeddings) and write the rotated key
        and ``v [B, Hkv, D]`` at ``write_pos - 1`` in one kernel (``rotary_qk_into_cache``) -> rotated q
        ``[B, Hq, D]``: what :meth:`update` then the model's rotation would store and return, with the host counters
        advanced as :meth:`update` advances them."""
        self._reserve(self._length + 1)
        self.new_start = self._length
        self._length += 1
        self.seen += 1
        return rotary_qk_into_cache(q, k, v, cos, sin, self._keys, self._values, self._write_pos)

    def write_rows(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   valid_end: torch.Tensor) -> None:
        """Write one token per row at its own position: keys/values [B, Hkv, 1, D] at ``slots`` [B] (long, below
        ``capacity``: the buffers do not grow); ``valid_end`` [B] becomes ``kv_end``."""
        B, H, _, D = keys.shape
        index = slots.view(B, 1, 1, 1).expand(B, H, 1, D)
        self._keys.scatter_(2, index, keys)
        self._values.scatter_(2, index.expand(B, H, 1, values.shape[-1]), values)
        self._kv_end.copy_(valid_end)

    def compact(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep only ``positions`` [B, W] (long) of each row, moved to the front of fresh buffers of W positions;
        row ``b`` then holds ``valid[b]`` valid tokens from position 0 (left padding is gone). Allocates: a method
        compacts once (StreamingLLM at its first decode step), before any step is captured."""
        B, H, _, D = self._keys.shape
        width = positions.shape[1]
        index = positions[:, None, :, None].expand(B, H, width, D)
        self._keys = self._keys.gather(2, index)
        self._values = self._values.gather(2, index.expand(B, H, width, self._values.shape[-1]))
        self._length = width
        self._kv_start.zero_()
        self._kv_end.copy_(valid.to(torch.int32))
        self.kv_start_host = [0] * B
        self.returned_keys = self._keys  # what the next update returns: the old buffers are no longer held
        self.evicted = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new keys/values [B, Hkv, T, D]; return what dense attention over the cache needs (the written
        part of the buffers; for a decode token the whole buffers, which the decode path reads by ``kv_end``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        if self.evicted and T > 1:
            raise RetrofitError(f"sparse method {self.method.name!r} evicted tokens at its first decode step: "
                                "a multi-token forward cannot follow (no speculative or chunked decoding)")
        self.new_start = self._length
        self.method.append(self, key_states, value_states)
        self.seen += T
        if T == 1:
            keys, values = self._keys, self._values
        else:
            keys, values = self._keys[:, :, : self._length], self._values[:, :, : self._length]
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
        self.__init__(self.layer_idx, self.method, self.static_capacity)

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
        valid = valid[:, : self._length]
        if valid.shape[0] == 1 and self._kv_start.shape[0] > 1:
            valid = valid.expand(self._kv_start.shape[0], -1)
        first = valid.int().argmax(-1)
        contiguous = valid.sum(-1) == valid.shape[-1] - first
        if not bool(contiguous.all()):
            raise RetrofitError("sparse decoding needs left padding (tokenizer.padding_side = 'left')")
        self._kv_start.copy_(first.to(torch.int32))
        self.kv_start_host = [int(row) for row in first.tolist()]

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

    def __init__(self, config, method: "SparseMethod", sparse_layers: list[int], num_layers: int,
                 capacity: int | None = None, base_layers: list | None = None):
        super().__init__(config=config)
        if base_layers is not None:  # a static cache: the engine's layers (static, ring, linear) for the rest
            self.layers = list(base_layers)
        elif capacity is not None:
            self.layers = list(StaticCache(config=config, max_cache_len=capacity).layers)
        if len(self.layers) < num_layers or self.layer_class_to_replicate is not None:
            self.layers = [DynamicLayer() for _ in range(num_layers)]
            self.layer_class_to_replicate = None
        for idx in sparse_layers:
            self.layers[idx] = SparseLayer(idx, method, capacity)
        self.method = method
        self.sparse_layers = list(sparse_layers)
        self.capacity = capacity

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
