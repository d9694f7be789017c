"""ClusterKV (Liu et al., 2412.03213): k-means (cosine) on the keys; read whole clusters by ``q . centroid``.

After the prefill the keys of each (batch, kv head), sinks excepted, are clustered into ``n_clusters``; every
``recluster_every`` generated tokens the new keys get ``new_clusters`` clusters of their own (until then they are
read exactly). Per decode step clusters are scored by ``q . centroid`` (centroid = mean key of the cluster, max over
the GQA group) and taken whole, best first, while they fit in the budget left after sinks and unclustered tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.kernels.sparse_decode import cluster_scores
from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import grown, mask_to_selection, positions, sink_mask


def kmeans_cosine(x: torch.Tensor, valid: torch.Tensor, k: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched spherical k-means.

    x [M, n, D], valid [M, n] bool -> (assign [M, n] long, -1 where invalid; centroids [M, k, D] = mean member key
    (fp32); sizes [M, k] long). Deterministic: initial centres are valid points evenly spaced in position order.
    """
    M, n, D = x.shape
    rows = max(1, (1 << 28) // max(n * k, 1))  # bound the [rows, n, k] similarity tensor to 1 GiB
    if M > rows:
        parts = [kmeans_cosine(x[i : i + rows], valid[i : i + rows], k, iterations) for i in range(0, M, rows)]
        return tuple(torch.cat(items) for items in zip(*parts))
    xf = x.float()
    unit = torch.nn.functional.normalize(xf, dim=-1) * valid[..., None]
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    n_valid = valid.sum(-1, keepdim=True).clamp(min=1)
    pick = (torch.arange(k, device=x.device)[None, :] * n_valid // k).clamp(max=n - 1)
    centres = unit.gather(1, order.gather(1, pick)[..., None].expand(M, k, D))
    assign = torch.zeros(M, n, dtype=torch.long, device=x.device)
    for _ in range(max(iterations, 1)):
        assign = torch.einsum("mnd,mkd->mnk", unit, centres).argmax(-1)
        sums = torch.zeros(M, k, D, device=x.device).scatter_add_(1, assign[..., None].expand(M, n, D), unit)
        norms = sums.norm(dim=-1, keepdim=True)
        centres = torch.where(norms > 0, sums / norms.clamp(min=1e-12), centres)
    assign = torch.where(valid, assign, -1)
    member = valid[..., None].float()
    index = assign.clamp(min=0)[..., None].expand(M, n, D)
    sums = torch.zeros(M, k, D, device=x.device).scatter_add_(1, index, xf * member)
    sizes = torch.zeros(M, k, device=x.device, dtype=torch.long).scatter_add_(1, assign.clamp(min=0), valid.long())
    means = sums / sizes.clamp(min=1)[..., None]
    return assign, means, sizes


@register("clusterkv")
@dataclass
class ClusterKV(SparseMethod):
    """``n_clusters`` at prefill (``iterations`` k-means steps); ``new_clusters`` per ``recluster_every`` new tokens."""

    n_clusters: int = 400
    iterations: int = 20
    recluster_every: int = 320
    new_clusters: int = 8
    n_sink: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("n_clusters", "iterations", "recluster_every", "new_clusters"):
            value = getattr(self, field)
            require(isinstance(value, int) and value > 0, field, value, "a positive integer")
        require(isinstance(self.n_sink, int) and 0 <= self.n_sink < self.budget, "n_sink", self.n_sink,
                f"an integer in [0, budget={self.budget})")

    def _cluster(self, layer, lo: int, hi: int, k: int) -> None:
        meta = layer.meta
        B, H, _, D = layer.keys.shape
        pos = torch.arange(lo, hi, device=layer.keys.device)
        valid = (pos[None, :] >= layer.kv_start.long()[:, None] + self.n_sink).expand(B, -1)
        valid = valid[:, None, :].expand(B, H, hi - lo).reshape(B * H, hi - lo)
        keys = layer.keys[:, :, lo:hi].reshape(B * H, hi - lo, D)
        assign, means, sizes = kmeans_cosine(keys, valid, k, self.iterations)
        base = meta.get("num_clusters", 0)
        meta["centroids"] = grown(meta.get("centroids"), 2, base + k, layer.keys, (B, H, 0, D))
        meta["sizes"] = grown(meta.get("sizes"), 2, base + k, torch.empty(0, dtype=torch.int32, device=pos.device),
                              (B, H, 0))
        meta["centroids"][:, :, base : base + k] = means.view(B, H, k, D).to(layer.keys.dtype)
        meta["sizes"][:, :, base : base + k] = sizes.view(B, H, k).to(torch.int32)
        offset = torch.where(assign >= 0, assign + base, assign).view(B, H, hi - lo)
        meta["assign"][:, :, lo:hi] = offset.to(torch.int32)
        meta["num_clusters"] = base + k
        meta["clustered_upto"] = hi

    def prepare(self, layer, start: int, end: int) -> None:
        meta = layer.meta
        B, H = layer.keys.shape[:2]
        meta["assign"] = grown(meta.get("assign"), 2, end, torch.empty(0, dtype=torch.int32, device=layer.keys.device),
                               (B, H, 0), fill=-1)
        if "num_clusters" not in meta:
            self._cluster(layer, 0, end, self.n_clusters)
        elif end - meta["clustered_upto"] >= self.recluster_every:
            self._cluster(layer, meta["clustered_upto"], end, self.new_clusters)

    def select(self, layer, query: torch.Tensor) -> Selection:
        meta = layer.meta
        n, num = layer.length, meta["num_clusters"]
        pos = positions(layer)
        recent_from = max(meta["clustered_upto"], n - (self.budget - self.n_sink))
        fixed = sink_mask(layer, self.n_sink) | ((pos >= recent_from) & (pos >= layer.kv_start.long()[:, None]))
        sizes = meta["sizes"][:, :, :num]
        scores = cluster_scores(query, meta["centroids"], num).masked_fill(sizes == 0, float("-inf"))
        order = torch.argsort(scores, dim=-1, descending=True, stable=True)
        room = (self.budget - fixed.sum(-1, keepdim=True))[:, None, :]  # [B, 1, 1]
        taken_sorted = torch.cumsum(sizes.gather(-1, order), -1) <= room
        taken = torch.zeros_like(taken_sorted).scatter_(-1, order, taken_sorted)
        assign = meta["assign"][:, :, :n].long()
        chosen = taken.gather(-1, assign.clamp(min=0)) & (assign >= 0)
        return mask_to_selection(chosen | fixed[:, None, :])
