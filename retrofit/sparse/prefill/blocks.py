"""The block grid of one prefill call and the choice of blocks every prefill method shares.

A prefill call runs ``T`` queries at positions ``[q_offset, q_offset + T)`` over ``N`` keys (the keys written so far,
the chunk's own last: ``q_offset = N - T``), rows left-padded before ``kv_start``. Queries and keys are cut into
blocks of ``block_size`` positions counted from position 0 (:class:`BlockGrid`); a key block is *causal* for a query
block when it holds a key some query of the block may see (not after the block, not all padding). A method
estimates, per query head and query block, the share of the attention each causal key block holds
(``PrefillMethod.block_mass``); :func:`choose_blocks` then keeps the sink and local blocks, and adds the others from the
largest share down until the kept ones hold ``threshold`` of the estimate (at most ``max_density`` of the causal blocks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from retrofit.kernels.sparse_prefill import query_block_count


@dataclass(frozen=True)
class BlockGrid:
    """Blocks of one prefill call: ``T`` queries from position ``q_offset`` over ``N`` keys, ``kv_start [B]`` (long,
    on the queries' device) the first valid key of each row, blocks of ``block_size`` positions; ``ends_prompt``
    False for a chunk of a prompt that more chunks follow (:func:`.patch.prompt_continues`)."""

    T: int
    N: int
    q_offset: int
    block_size: int
    kv_start: torch.Tensor
    ends_prompt: bool = True

    @property
    def first_block(self) -> int:
        """The block holding the first query: row 0 of a selection."""
        return self.q_offset // self.block_size

    @property
    def rows(self) -> int:
        """Query blocks the chunk touches (rows of a selection)."""
        return query_block_count(self.q_offset, self.T, self.block_size)

    @property
    def key_blocks(self) -> int:
        return math.ceil(self.N / self.block_size)

    def _ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.kv_start.device
        query_blocks = torch.arange(self.first_block, self.first_block + self.rows, device=device)
        return query_blocks[:, None], torch.arange(self.key_blocks, device=device)[None, :]

    def causal(self) -> torch.Tensor:
        """[B, 1, rows, key_blocks] bool: key block ``n`` holds a key some query of block ``m`` may see (``n <= m``,
        and not all left padding)."""
        m, n = self._ids()
        not_padding = (n + 1) * self.block_size > self.kv_start[:, None, None]  # [B, 1, nK]
        return ((n <= m)[None] & not_padding)[:, None]

    def kept(self, sink_blocks: int, local_blocks: int, last_query_blocks: int = 0) -> torch.Tensor:
        """[B, 1, rows, key_blocks] bool: the blocks always computed: the first ``sink_blocks`` blocks of each row's
        real tokens (the attention sinks), the ``local_blocks`` blocks ending at the query block's own (the
        diagonal), and every block of the call's last ``last_query_blocks`` query blocks when the call ends the prompt
        (the first new token is read from its last position), where causal."""
        m, n = self._ids()
        sink = self.kv_start[:, None, None] // self.block_size
        sinks = (n >= sink) & (n < sink + sink_blocks)  # [B, 1, nK]
        local = (n <= m) & (n > m - local_blocks)  # [rows, nK]
        full_rows = last_query_blocks if self.ends_prompt else 0
        last_rows = m >= self.first_block + self.rows - full_rows  # [rows, 1]
        return (sinks | (local | last_rows)[None])[:, None] & self.causal()


def left_padding(attention_mask: torch.Tensor | None, batch: int, keys: int,
                 device: torch.device) -> torch.Tensor | None:
    """Each row's first valid key [B] (long) from the mask a prefill call receives (4D bool, or additive float with
    0 where allowed; None: no padding), or None when the mask is not causal attention over left-padded rows whose
    last query sees the last key (another layout: the caller runs dense). A row whose chunk is all padding (its last
    query sees nothing) gets ``keys``: nothing valid. Reads the mask's last query row only."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4 or attention_mask.shape[-1] != keys:
        return None
    last = attention_mask[:, 0, -1, :]
    valid = last if last.dtype == torch.bool else last == 0
    valid = valid.expand(batch, keys)
    seen = valid.any(-1)
    first = torch.where(seen, valid.int().argmax(-1), keys)
    contiguous = (valid.sum(-1) == keys - first) & (valid[:, -1] | ~seen)
    if not bool(contiguous.all()):
        return None
    return first.long().to(device)


def choose_blocks(mass: torch.Tensor, causal: torch.Tensor, kept: torch.Tensor, threshold: float,
                  max_density: float) -> torch.Tensor:
    """The blocks computed: mass [B, H, rows, nK] (the estimated share of each query block's attention in each key
    block), causal/kept [B, 1, rows, nK] (:meth:`BlockGrid.causal`, :meth:`BlockGrid.kept`) -> [B, H, rows, nK] bool.

    Per row: the kept blocks, then the other causal blocks from the largest mass down while the mass taken before a
    block is below ``threshold`` of the row's causal mass (the kept blocks' mass counts), at most ``ceil(max_density
    * causal blocks)`` blocks in all (the kept ones always). ``threshold >= 1`` with ``max_density >= 1`` keeps
    every causal block."""
    B, H, rows, nK = mass.shape
    if threshold >= 1 and max_density >= 1:
        return causal.expand(B, H, rows, nK).clone()
    mass = torch.where(causal, mass.float(), 0.0)
    rank_key = torch.where(kept, float("inf"), torch.where(causal, mass, float("-inf")))
    order = torch.sort(rank_key, dim=-1, descending=True, stable=True).indices
    ordered = mass.gather(-1, order)
    before = ordered.cumsum(-1) - ordered
    total = mass.sum(-1, keepdim=True)
    take = before < threshold * total if threshold < 1 else torch.ones_like(before, dtype=torch.bool)
    if max_density < 1:
        allowed = torch.maximum(kept.sum(-1, keepdim=True), torch.ceil(max_density * causal.sum(-1, keepdim=True)))
        take &= torch.arange(nK, device=mass.device) < allowed
    chosen = torch.zeros_like(take).scatter(-1, order, take)
    return (chosen & causal) | kept


def block_lists(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen [B, H, rows, nK] bool -> (indices [B, H, rows, S] int32, ascending, S the largest count (at least 1);
    counts [B, H, rows] int32): the selection the kernel reads."""
    counts = chosen.sum(-1, dtype=torch.int32)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    return order.to(torch.int32), counts
