"""Quest (Tang et al., 2406.10774): page-level key min/max bound the attention logit; read the top pages.

Metadata per page of ``page_size`` positions: element-wise min and max of its keys (padding excluded). Per decode
step: ``score = sum_d max(q_d*max_d, q_d*min_d)`` (max over the query heads of a GQA group), top
``budget // page_size`` pages with the page holding the newest token always among them (the authors' kernel tops-k
the other pages and appends the last one), sparse attention over them. The first ``dense_layers`` stay dense
(authors' setting).

Page size: the authors' 16 is the default (their models have head_dim 128). With head_dim 64 the page bound is
looser: on SmolLM2-135M at budget 1024 (H200, 20 seeds) page 16 keeps 5% of dense on niah_single@8000, page 8 70%,
page 4 100% (and >= 90% of dense in every graded cell at 2048, 4096, 8000); see BENCHMARKS.md, History > Sparse
decoding: accuracy > 2026-11-30 — Quest page 4 and Seer gates trained on sequences of 2048-8192 tokens meet the bar
at every length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.kernels.sparse_decode import quest_page_scores
from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import best_blocks, full_counts, grown


@register("quest")
@dataclass
class Quest(SparseMethod):
    """Pages of ``page_size`` tokens (must divide ``budget``); ``dense_layers``: layer indices kept dense."""

    page_size: int = 16
    dense_layers: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.page_size, int) and self.page_size > 0, "page_size", self.page_size,
                "a positive integer")
        require(self.budget % self.page_size == 0, "page_size", self.page_size,
                f"a divisor of budget={self.budget}")
        self.dense_layers = tuple(self.dense_layers)
        require(all(isinstance(i, int) and i >= 0 for i in self.dense_layers), "dense_layers", self.dense_layers,
                "non-negative layer indices")

    def prepare(self, layer, start: int, end: int) -> None:
        if end <= start or layer.layer_idx in self.dense_layers:
            return
        ps = self.page_size
        first, last = start // ps, -(-end // ps)
        B, H, _, D = layer.keys.shape
        meta = layer.meta
        for name in ("page_min", "page_max"):
            meta[name] = grown(meta.get(name), 2, last, layer.keys, (B, H, 0, D))
        span = layer.keys[:, :, first * ps : end]
        pad = (last - first) * ps - span.shape[2]
        pos = torch.arange(first * ps, last * ps, device=span.device)
        valid = (pos[None, :] >= layer.kv_start.long()[:, None]) & (pos[None, :] < end)  # [B, L]
        span = torch.nn.functional.pad(span, (0, 0, 0, pad)).view(B, H, last - first, ps, D)
        valid = valid.view(B, 1, last - first, ps, 1)
        page_min = torch.where(valid, span, float("inf")).amin(3)
        page_max = torch.where(valid, span, float("-inf")).amax(3)
        meta["page_min"][:, :, first:last] = torch.where(torch.isinf(page_min), 0, page_min)
        meta["page_max"][:, :, first:last] = torch.where(torch.isinf(page_max), 0, page_max)
        meta["num_pages"] = last

    def select(self, layer, query: torch.Tensor) -> Selection | None:
        if layer.layer_idx in self.dense_layers:
            return None
        meta = layer.meta
        num_pages = meta["num_pages"]
        scores = quest_page_scores(query, meta["page_min"], meta["page_max"], num_pages, layer.kv_start, self.page_size)
        top = best_blocks(layer, scores, min(self.budget // self.page_size, num_pages))
        return Selection(top, full_counts(layer, top), self.page_size)
