"""The sparse-decoding method contract: what a method is asked and what it answers.

A method is a small dataclass (validated in ``__post_init__`` with :func:`require`) with hooks the cache and the
patch call:

- ``prepare(layer, start, end)``: positions ``[start, end)`` were just written to ``layer``'s key/value buffers by a
  prefill chunk (host-known positions); build the method's metadata in ``layer.meta`` (page min/max, centroids, ANN
  index, gate keys);
- ``prepare_step(layer)``: one decode token was just written at ``layer.write_pos - 1``; update the metadata;
- ``select(layer, query) -> Selection | None``: which blocks of the cache one decode query reads (``None``: dense);
- ``maintain(layer, written)``: upkeep between decode steps, on the host (ClusterKV's scheduled re-clustering);
- ``bind(config)``: settings that follow the model (called once by ``sparse_decoding``).

A decode step must be able to run as a captured CUDA graph (``capturable``): ``prepare_step`` and ``select`` then
read and write only device tensors of fixed shape, metadata is updated in place, selections have a fixed width
(index tensors sized by the budget, with counts), and nothing reads a tensor value on the host (no ``.item()``,
``nonzero`` or Python branch on a tensor). A method whose selection needs the host (RetrievalAttention's faiss
search) sets ``capturable = False`` and says what its step costs.

A method reads the layer's buffers and changes them only through ``SparseLayer``'s methods (``write``,
``write_rows``, ``compact``); everything else (storage, padding, the attention kernel, restoring the model) is
shared.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from retrofit.errors import RetrofitError

if TYPE_CHECKING:
    from retrofit.sparse.cache import SparseLayer


@dataclass
class Selection:
    """The blocks one decode step attends to, per (batch, kv head).

    indices [B, Hkv, S] int32 block ids (a block is ``block_size`` consecutive buffer positions), counts [B, Hkv]
    int32 number of valid entries per row (ragged; entries past the count are ignored).
    """

    indices: torch.Tensor
    counts: torch.Tensor
    block_size: int = 1


@dataclass
class SparseMethod(ABC):
    """Base of every sparse method. ``budget``: tokens read per kv head per decode step (sinks and window included)."""

    budget: int
    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = False
    capturable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        require(isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget > 0,
                "budget", self.budget, "a positive number of tokens")

    def prepare(self, layer: "SparseLayer", start: int, end: int) -> None:
        """Update ``layer.meta`` after positions ``[start, end)`` were written (default: no metadata)."""

    def prepare_step(self, layer: "SparseLayer") -> None:
        """Update ``layer.meta`` after one decode token per row was written at ``layer.write_pos - 1`` (default:
        :meth:`prepare` over the host-known new position, which a method that is ``capturable`` must override)."""
        self.prepare(layer, layer.new_start, layer.length)

    def maintain(self, layer: "SparseLayer", written: int) -> None:
        """Host-side upkeep between decode steps, outside the step (``written``: tokens in the layer; default none)."""

    def bind(self, config) -> None:
        """Adopt settings that follow the model (its text ``config``), once, before any forward (default none)."""

    def append(self, layer: "SparseLayer", keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new keys/values [B, Hkv, T, D] (default: a prefill chunk at the common write position, a decode
        token at the device write position)."""
        if keys.shape[2] == 1:
            layer.write_next(keys, values)
        else:
            layer.write(keys, values)

    def plain_decode_write(self) -> bool:
        """Whether a decode token is stored the default way (:meth:`append`'s ``write_next`` at ``write_pos``): then
        the engine's fused decode layers may rotate and write it with one kernel (``SparseLayer.write_rotated_next``).
        A method that overrides :meth:`append` (StreamingLLM's ring) answers no."""
        return type(self).append is SparseMethod.append

    @abstractmethod
    def select(self, layer: "SparseLayer", query: torch.Tensor) -> Selection | None:
        """Blocks read by the decode query [B, Hq, D] (post-RoPE), or None to attend densely."""

    def step_read_bytes(self, layer: "SparseLayer", valid_tokens: int) -> int:
        """Bytes one decode step reads from ``layer`` when each row holds ``valid_tokens`` positions: the keys and
        values of the tokens selected (at most ``budget`` per row and kv head; all of them in a layer the method
        keeps dense) plus the method's metadata on the device, which a step scores whole."""
        keys, values = layer.keys, layer.values
        per_token = keys[:, :, :1].numel() * keys.element_size() + values[:, :, :1].numel() * values.element_size()
        if self.keeps_dense(layer):
            return per_token * valid_tokens
        metadata = sum(t.numel() * t.element_size() for t in layer.meta.values()
                       if isinstance(t, torch.Tensor) and t.device == keys.device)
        return per_token * min(self.budget, valid_tokens) + metadata

    def keeps_dense(self, layer: "SparseLayer") -> bool:
        """Whether the method leaves ``layer`` dense (its ``select`` returns None there; default: never)."""
        return False

    def metadata_bytes(self, layer: "SparseLayer") -> dict[str, int]:
        """Bytes held by this method's metadata of one layer, per component (default: tensors in layer.meta)."""
        return {"metadata": sum(t.numel() * t.element_size() for t in layer.meta.values()
                                if isinstance(t, torch.Tensor))}


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """Raise a one-line RetrofitError naming the field when a parameter is invalid."""
    if not ok:
        raise RetrofitError(f"sparse method parameter {field}={value!r} is invalid: expected {expected}")
