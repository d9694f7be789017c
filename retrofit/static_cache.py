"""The preallocated cache layers of one generation, as the architecture record says each layer needs.

- an unbounded softmax layer: transformers' ``StaticLayer`` of ``capacity`` positions;
- a sliding-window layer whose window is shorter than ``capacity``: a :class:`RingLayer` of ``window`` positions
  (its memory does not grow with the context); with a window of at least ``capacity`` the window can never act and
  the layer is an unbounded one;
- a linear-attention layer (converted, or a family's native one): transformers' ``LinearAttentionLayer``.

``retrofit.generate`` and a ``retrofit.sparse_decoding`` session's static cache build their layers here.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer, StaticLayer

from retrofit.model_info import attention_layout


class RingLayer(CacheLayerMixin):
    """The keys and values of a sliding-window layer: the last ``size = min(window, capacity)`` positions, position
    ``p`` in slot ``p % size`` of ``keys``/``values [B, Hkv, size, D]``.

    A prefill chunk of ``T`` tokens at the host-known position ``written`` (:meth:`update`) returns the keys its
    queries may see, in position order: the ring's positions ``[kv_offset, written)`` (``kv_offset = max(0, written -
    window + 1)``) followed by the chunk's own, so that the columns ``[kv_offset, written + T)`` of the model's
    sliding-window mask are its mask; then the chunk's last ``size`` tokens go into their slots. A decode token is
    written at slot ``cumulative_length % size``, a device counter advanced in place: no host read, so a step can
    be captured as a CUDA graph. Which slots a decode query reads is :func:`ring_selection`.
    """

    is_sliding = True
    is_compileable = False
    is_croppable = False

    def __init__(self, window: int, capacity: int):
        super().__init__()
        self.window = int(window)
        self.size = min(self.window, int(capacity))
        self.written = 0
        self.kv_offset = 0
        self.cumulative_length = torch.zeros((), dtype=torch.long)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(B, H, self.size, D)
        self.values = value_states.new_zeros(B, H, self.size, value_states.shape[-1])
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store keys/values ``[B, Hkv, T, D]``; return the keys/values the queries attend over (see the class)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[2]
        if T == 1:  # a decode token (or a one-token prefill chunk, which attends the same way)
            slot = torch.remainder(self.cumulative_length, self.size).view(1)
            self.keys.index_copy_(2, slot, key_states)
            self.values.index_copy_(2, slot, value_states)
            self.cumulative_length.add_(1)
            self.written += 1
            return self.keys, self.values
        start = self.written
        self.kv_offset = max(0, start - self.window + 1)
        earlier = torch.arange(self.kv_offset, start, device=self.device) % self.size
        keys = torch.cat([self.keys.index_select(2, earlier), key_states], dim=2)
        values = torch.cat([self.values.index_select(2, earlier), value_states], dim=2)
        kept = min(T, self.size)
        slots = torch.arange(start + T - kept, start + T, device=self.device) % self.size
        self.keys.index_copy_(2, slots, key_states[:, :, T - kept:])
        self.values.index_copy_(2, slots, value_states[:, :, T - kept:])
        self.written += T
        self.cumulative_length.fill_(self.written)
        return keys, values

    def get_seq_length(self) -> int:
        return self.written

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # transformers < 5.2x passes cache_position
            query_length = query_length.shape[0]
        return self.written + query_length, 0

    def get_max_length(self) -> int:
        return self.window

    def reset(self) -> None:
        """Empty the ring, keeping its buffers (a captured decode step reads them at their addresses)."""
        self.written = 0
        self.kv_offset = 0
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.cumulative_length.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search over a ring cache is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a ring cache cannot be cropped")

    def offload(self):  # noqa: D102 - the ring stays where it is
        pass

    def prefetch(self):  # noqa: D102
        pass


def ring_selection(layer: RingLayer, row_start: torch.Tensor, offsets: torch.Tensor, kv_heads: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of ``layer`` a decode query reads, the token just written included, as a selection of single
    positions for ``sparse_decode_attention`` over the ring buffers (valid range ``[0, size)``).

    ``row_start [B]``: each row's first real position (left padding before it); ``offsets``: ``arange(size)`` on the
    device. Row ``b`` reads positions ``first_b .. p`` where ``p`` is the token's position and ``first_b =
    max(row_start_b, p - window + 1, 0)``: slots ``(first_b + j) % size`` for ``j < p + 1 - first_b``. Device ops
    only. -> (indices ``[B, Hkv, size]`` int32, counts ``[B, Hkv]`` int32)."""
    position = layer.cumulative_length - 1
    first = torch.maximum(row_start.to(torch.long), (position - layer.window + 1).clamp_min(0))
    counts = (position + 1 - first).to(torch.int32)
    slots = torch.remainder(first[:, None] + offsets[None, :], layer.size).to(torch.int32)
    B = slots.shape[0]
    return slots[:, None, :].expand(B, kv_heads, layer.size), counts[:, None].expand(B, kv_heads)


def static_layers(model: torch.nn.Module, capacity: int) -> list[CacheLayerMixin]:
    """One preallocated cache layer per decoder layer of ``model`` for generations of at most ``capacity``
    positions (see the module docstring)."""
    layout = attention_layout(model)
    layers: list[CacheLayerMixin] = []
    for index, kind in enumerate(layout.layer_types):
        window = layout.layers[index].window
        if kind not in ("full_attention", "sliding_attention"):
            layers.append(LinearAttentionLayer())
        elif window is not None and window < capacity:
            layers.append(RingLayer(window, capacity))
        else:
            layers.append(StaticLayer(max_cache_len=capacity))
    return layers
