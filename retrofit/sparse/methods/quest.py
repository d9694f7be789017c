"""Quest (Tang et al., 2406.10774): page-level key min/max bound the attention logit; read the top pages.

Metadata per page of ``page_size`` positions: element-wise min and max of its keys (padding excluded). Per decode
step: ``score = sum_d max(q_d*max_d, q_d*min_d)`` (max over the query heads of a GQA group), top
``budget // page_size`` pages with the page holding the newest token always among them (the authors' kernel tops-k
the other pages and appends the last one), sparse attention over them. The first ``dense_layers`` stay dense
(authors' setting).

Page size follows the head dimension (:func:`default_page_size`): the authors' 16 for head_dim 128, 4 for head_dim
64. With head_dim 64 the page bound is looser: on SmolLM2-135M at budget 1024 (H200, 20 seeds) page 16 keeps 5% of
dense on niah_single@8000, page 8 70%, page 4 100% (and >= 90% of dense in every graded cell at 2048, 4096, 8000);
see BENCHMARKS.md, History > Sparse decoding: accuracy > 2026-11-30 — Quest page 4 and Seer gates trained on
sequences of 2048-8192 tokens meet the bar at every length.

The metadata covers every page of the buffer (a static cache: prompt + new tokens) and a decode step updates the
page of the new token in place and scores every page (pages without a valid position of a row score -inf): fixed
shapes, no host read, so the step can be captured.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.kernels.sparse_decode import page_bounds, quest_page_scores, quest_page_update
from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import best_blocks, blocks_written, full_counts, grown


def default_page_size(head_dim: int) -> int:
    """Quest's page size for keys of ``head_dim`` channels: 16 (the authors') at head_dim 128 and above, and
    smaller for narrower heads, as ``16 * (head_dim / 128) ** 2`` rounded down to a power of two (64 -> 4, 96 -> 8,
    32 -> 1).

    Why: the page bound sums a per-channel maximum over the page's keys, so it loosens as pages grow and weighs
    each channel more when there are fewer; on SmolLM2-135M (head_dim 64) page 16 kept 20% of dense on niah_single
    at budget 256 where page 4 kept 100% (30 identical 2K items beside kvpress 0.5.5), and at budget 1024 page 16
    kept 5%, page 8 70%, page 4 100% (BENCHMARKS.md, History > Sparse decoding: accuracy). The two measured head
    dimensions fix the rule at 128 -> 16 and 64 -> 4; between and beyond them it is an interpolation.
    """
    scaled = 16 * (head_dim / 128) ** 2
    return max(1, min(16, 1 << max(0, int(scaled).bit_length() - 1)))


@register("quest")
@dataclass
class Quest(SparseMethod):
    """Pages of ``page_size`` tokens (must divide ``budget``; default :func:`default_page_size` of the model's head
    dimension); ``dense_layers``: layer indices kept dense."""

    page_size: int | None = None
    dense_layers: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size is not None:
            self._check_page_size()
        self.dense_layers = tuple(self.dense_layers)
        require(all(isinstance(i, int) and i >= 0 for i in self.dense_layers), "dense_layers", self.dense_layers,
                "non-negative layer indices")

    def _check_page_size(self) -> None:
        require(isinstance(self.page_size, int) and self.page_size > 0, "page_size", self.page_size,
                "a positive integer")
        require(self.budget % self.page_size == 0, "page_size", self.page_size,
                f"a divisor of budget={self.budget}")

    def bind(self, config) -> None:
        if self.page_size is None:
            from retrofit import architecture

            self.page_size = default_page_size(architecture.of(config).head_dim(config))
            self._check_page_size()

    def keeps_dense(self, layer) -> bool:
        return layer.layer_idx in self.dense_layers

    def _page_buffers(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """page_min, page_max [B, Hkv, P, D] for the P pages of the buffer (grown with a growing cache)."""
        B, H, _, D = layer.keys.shape
        pages = -(-layer.capacity // self.page_size)
        meta = layer.meta
        for name in ("page_min", "page_max"):
            meta[name] = grown(meta.get(name), 2, pages, layer.keys, (B, H, 0, D))
        return meta["page_min"], meta["page_max"]

    def prepare(self, layer, start: int, end: int) -> None:
        if end <= start or layer.layer_idx in self.dense_layers:
            return
        page_min, page_max = self._page_buffers(layer)
        pages, span, valid = blocks_written(layer, start, end, self.page_size)
        page_min[:, :, pages], page_max[:, :, pages] = page_bounds(span, valid, self.page_size)

    def prepare_step(self, layer) -> None:
        """The page of the token just written at ``write_pos - 1``: its min/max again, on the device."""
        if layer.layer_idx in self.dense_layers:
            return
        page_min, page_max = self._page_buffers(layer)
        quest_page_update(layer.keys, page_min, page_max, layer.write_pos, layer.kv_start, layer.kv_end,
                          self.page_size)

    def select(self, layer, query: torch.Tensor) -> Selection | None:
        if layer.layer_idx in self.dense_layers:
            return None
        meta = layer.meta
        pages = -(-layer.capacity // self.page_size)
        scores = quest_page_scores(query, meta["page_min"], meta["page_max"], pages, layer.kv_start, self.page_size)
        top = best_blocks(layer, scores, min(self.budget // self.page_size, pages), self.page_size)
        return Selection(top, full_counts(layer, top), self.page_size)

