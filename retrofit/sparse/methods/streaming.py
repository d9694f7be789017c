"""StreamingLLM (Xiao et al., 2309.17453): keep the first ``n_sink`` tokens and the last ``window`` tokens.

Evicts for real: at the first decode step each row keeps at most ``n_sink + window`` keys/values (the buffer is
reallocated to that size; the prefill, in one call or in chunks, attends densely), and every new token overwrites the
oldest window slot (a ring; attention is order-invariant). Keys keep the rotary positions they were computed with
(no re-positioning inside the cache). After that first step a step only writes its ring slot (computed on the
device) and reads every slot: fixed shapes, no host read, so it can be captured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import all_blocks


@register("streaming")
@dataclass
class StreamingLLM(SparseMethod):
    """budget = n_sink + window tokens; ``window`` defaults to ``budget - n_sink``."""

    n_sink: int = 4
    window: int | None = None
    evicts = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.n_sink, int) and 0 <= self.n_sink < self.budget, "n_sink", self.n_sink,
                f"an integer in [0, budget={self.budget})")
        if self.window is None:
            self.window = self.budget - self.n_sink
        require(isinstance(self.window, int) and 1 <= self.window <= self.budget - self.n_sink, "window",
                self.window, f"an integer in [1, budget - n_sink = {self.budget - self.n_sink}]")

    @property
    def capacity(self) -> int:
        return self.n_sink + self.window

    def append(self, layer, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not layer.evicted:
            super().append(layer, keys, values)
            return
        meta = layer.meta
        count, ring = meta["count"], meta["ring"]
        full = count >= self.capacity
        slot = torch.where(full, self.n_sink + ring, count)
        ring.copy_(torch.where(full, (ring + 1) % self.window, ring))
        count.copy_(torch.clamp(count + 1, max=self.capacity))
        layer.write_rows(slot, keys, values, valid_end=count)

    def prepare_step(self, layer) -> None:
        """At the first decode step, evict: keep each row's sinks and newest tokens in a ring of ``n_sink + window``
        slots (fresh buffers: the memory of the rest is freed). Afterwards nothing: :meth:`append` writes the ring."""
        if layer.evicted:
            return
        n, cap = layer.length, self.capacity
        start_pos = layer.kv_start.long()
        valid_len = n - start_pos
        keep = torch.clamp(valid_len, max=cap)
        # the ring holds at most cap tokens, and no more than the whole generation: the static cache's capacity
        width = min(cap, layer.static_capacity) if layer.static else cap
        j = torch.arange(width, device=start_pos.device)
        head = (valid_len[:, None] <= cap) | (j[None, :] < self.n_sink)
        pos = torch.where(head, start_pos[:, None] + j, n - cap + j)
        pos = torch.where(j[None, :] < keep[:, None], pos, torch.zeros_like(pos)).clamp(0, max(n - 1, 0))
        layer.compact(pos, keep)
        layer.meta.update(count=keep.clone(), ring=torch.zeros_like(keep))

    def select(self, layer, query: torch.Tensor) -> Selection:
        return all_blocks(layer)
