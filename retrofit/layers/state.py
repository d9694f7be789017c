"""Padding and cache plumbing of the linear-attention layers: which positions are real tokens, and where a layer's
conv and recurrent states (and a softmax window's ring) live in a transformers ``Cache`` (its linear-attention cache
layers)."""
from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from retrofit.layers.window import WindowRing

RING_ATTRIBUTE = "retrofit_window_ring"  # where a linear-attention cache layer holds a windowed layer's ring


def padding_mask(attention_mask, batch: int, length: int, device) -> torch.Tensor | None:
    """Which of the ``length`` current positions are real tokens: bool ``[B, T]``, or None when none is padded.

    Accepts the forms transformers hands to an attention module: None, a 2-D ``[B, S]`` 0/1 mask, or a 4-D
    ``[B, 1, T, S]`` (bool "may attend" or additive float) mask; for 4-D the diagonal of the last T key columns
    tells whether a position may attend to itself, i.e. whether it is a real token.
    """
    if attention_mask is None or isinstance(attention_mask, dict):
        return None
    m = attention_mask
    if m.dim() == 2:
        keep = m[:, -length:].bool()
    elif m.dim() == 4:
        square = m[:, 0, -length:, -length:]
        diag = torch.diagonal(square, dim1=-2, dim2=-1)
        keep = diag if diag.dtype == torch.bool else diag > torch.finfo(diag.dtype).min / 2
        if keep.shape[0] != batch:
            keep = keep.expand(batch, -1)
    else:
        return None
    keep = keep.to(device)
    if bool(keep.all()):
        return None
    return keep


def cache_states(cache, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv state ``[B, D, W-1]``, recurrent state ``[B, H, K, V]``) of a layer from a transformers Cache, or Nones."""
    if cache is None:
        return None, None
    layer = _linear_cache_layer(cache, layer_idx)
    if not layer.has_previous_state[0]:
        return None, None
    return layer.conv_states[0], layer.recurrent_states[0]


def store_states(cache, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
    """Write a layer's new conv and recurrent states into the cache (in place once allocated)."""
    layer = _linear_cache_layer(cache, layer_idx)
    layer.update_conv_state(conv_state, 0, conv_kernel_size=conv_state.shape[-1])
    layer.update_recurrent_state(recurrent_state, 0)


def _linear_cache_layer(cache, layer_idx: int):
    """The cache's layer object for ``layer_idx``, made a linear-attention layer if the cache was built without
    the hybrid config (e.g. a bare ``DynamicCache()``)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    if not isinstance(layers[layer_idx], LinearAttentionCacheLayerMixin):
        layers[layer_idx] = LinearAttentionLayer()
    return layers[layer_idx]


def window_ring(cache, layer_idx: int) -> WindowRing | None:
    """The ring a windowed layer keeps in the cache's layer ``layer_idx`` (:class:`WindowRing`), or None."""
    if cache is None:
        return None
    return getattr(_linear_cache_layer(cache, layer_idx), RING_ATTRIBUTE, None)


def keep_window_ring(cache, layer_idx: int, ring: WindowRing) -> None:
    """Hold ``ring`` in the cache's layer ``layer_idx``: copied into the ring held there when its buffers fit (so a
    captured decode step keeps reading them where they are, e.g. a generation reusing its cache after ``reset()``),
    else held as it is. The cache layer becomes a :class:`WindowedLinearAttentionLayer`, which moves the ring's rows
    with the states' when a search reorders the batch."""
    layer = _linear_cache_layer(cache, layer_idx)
    if type(layer) is LinearAttentionLayer:  # the same object (a captured step may hold it), the ring's behaviour
        layer.__class__ = WindowedLinearAttentionLayer
    held = getattr(layer, RING_ATTRIBUTE, None)
    if held is not None and held.fits(ring):
        held.copy_(ring)
    else:
        setattr(layer, RING_ATTRIBUTE, ring)


class WindowedLinearAttentionLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer holding a windowed layer's ring too (``retrofit_window_ring``):
    beam search's reordering of the batch moves the ring's rows with the conv and recurrent states'."""

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        ring = getattr(self, RING_ATTRIBUTE, None)
        if ring is not None:
            for tensor in ring.tensors():
                tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))
