"""The sparse-decoding method contract: what a method is asked and what it answers.

A method is a small dataclass (validated in ``__post_init__`` with :func:`require`) with two hooks the cache and the
patch call:

- ``prepare(layer, start, end)``: positions ``[start, end)`` were just written to ``layer``'s key/value buffers
  (prefill or an appended token); update the method's metadata in ``layer.meta`` (page min/max, centroids, ANN
  index, gate keys);
- ``select(layer, query) -> Selection | None``: which blocks of the cache one decode query reads (``None``: dense).

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

    def __post_init__(self) -> None:
        require(isinstance(self.budget, int) and not isinstance(self.budget, bool) and self.budget > 0,
                "budget", self.budget, "a positive number of tokens")

    def prepare(self, layer: "SparseLayer", start: int, end: int) -> None:
        """Update ``layer.meta`` after positions ``[start, end)`` were written (default: no metadata)."""

    def append(self, layer: "SparseLayer", keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new keys/values [B, Hkv, T, D] (default: append at the common write position)."""
        layer.write(keys, values)

    @abstractmethod
    def select(self, layer: "SparseLayer", query: torch.Tensor) -> Selection | None:
        """Blocks read by the decode query [B, Hq, D] (post-RoPE), or None to attend densely."""

    def metadata_bytes(self, layer: "SparseLayer") -> dict[str, int]:
        """Bytes held by this method's metadata of one layer, per component (default: tensors in layer.meta)."""
        return {"metadata": sum(t.numel() * t.element_size() for t in layer.meta.values()
                                if isinstance(t, torch.Tensor))}


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """Raise a one-line RetrofitError naming the field when a parameter is invalid."""
    if not ok:
        raise RetrofitError(f"sparse method parameter {field}={value!r} is invalid: expected {expected}")
