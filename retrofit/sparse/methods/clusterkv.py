"""ClusterKV (Liu et al., 2412.03213): k-means (cosine) on the keys; read whole clusters by ``q . centroid``.

After the prefill the keys of each (batch, kv head), sinks excepted, are clustered into ``n_clusters``; every
``recluster_every`` generated tokens the new keys get ``new_clusters`` clusters of their own (until then they are
read exactly). Per decode step clusters are scored by ``q . centroid`` (centroid = mean key of the cluster, max over
the GQA group) and taken whole, best first, while they fit in the budget left after sinks and unclustered tokens.

The clustering runs on the host between decode steps (:meth:`ClusterKV.maintain`, on a fixed schedule: before the
first decode step, then every ``recluster_every`` tokens), outside a captured step; the step itself scores every
cluster slot of the static buffers (empty slots score -inf) and selects ``budget`` tokens with counts: fixed shapes,
no host read. (Under ``model.generate`` the schedule is checked inside the step, a token earlier.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from retrofit.kernels.sparse_decode import cluster_scores, cluster_take, cluster_token_mask
from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import grown, mask_to_selection


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

    def _buffers(self, layer, clusters: int) -> None:
        """centroids [B, Hkv, C, D], sizes [B, Hkv, C] int32 for at least ``clusters`` clusters (none yet for 0),
        assign [B, Hkv, N] int32 (cluster of each position, -1: not clustered) for the N positions of the buffer. A
        static cache gets its cluster slots once, at the first upkeep: the prompt's clusters plus every scheduled
        batch (buffers that do not exist yet are allocated at the size asked, 16 at least)."""
        meta = layer.meta
        B, H, capacity, D = layer.keys.shape
        int32 = torch.empty(0, dtype=torch.int32, device=layer.keys.device)
        if clusters:
            meta["centroids"] = grown(meta.get("centroids"), 2, clusters, layer.keys, (B, H, 0, D))
            meta["sizes"] = grown(meta.get("sizes"), 2, clusters, int32, (B, H, 0))
        meta["assign"] = grown(meta.get("assign"), 2, capacity, int32, (B, H, 0), fill=-1)
        if "clustered_upto" not in meta:
            meta["clustered_upto"] = torch.zeros(1, dtype=torch.long, device=layer.keys.device)

    def _cluster(self, layer, lo: int, hi: int, k: int) -> None:
        meta = layer.meta
        B, H, _, D = layer.keys.shape
        pos = torch.arange(lo, hi, device=layer.keys.device)
        valid = (pos[None, :] >= layer.kv_start.long()[:, None] + self.n_sink).expand(B, -1)
        valid = valid[:, None, :].expand(B, H, hi - lo).reshape(B * H, hi - lo)
        keys = layer.keys[:, :, lo:hi].reshape(B * H, hi - lo, D)
        assign, means, sizes = kmeans_cosine(keys, valid, k, self.iterations)
        base = meta.get("num_clusters", 0)
        self._buffers(layer, base + k)
        meta["centroids"][:, :, base : base + k] = means.view(B, H, k, D).to(layer.keys.dtype)
        meta["sizes"][:, :, base : base + k] = sizes.view(B, H, k).to(torch.int32)
        offset = torch.where(assign >= 0, assign + base, assign).view(B, H, hi - lo)
        meta["assign"][:, :, lo:hi] = offset.to(torch.int32)
        meta["num_clusters"] = base + k
        meta["clustered_upto_host"] = hi
        meta["clustered_upto"].fill_(hi)

    def _scheduled_clusters(self, layer, prompt: int) -> int:
        """Clusters a static cache will hold: the prompt's plus ``new_clusters`` per ``recluster_every`` tokens."""
        return self.n_clusters + self.new_clusters * (max(0, layer.capacity - prompt) // self.recluster_every)

    def prepare(self, layer, start: int, end: int) -> None:
        if "num_clusters" in layer.meta:  # a later prefill chunk: clustered when decoding starts
            return
        # a static cache's cluster slots wait for the whole prompt (maintain): a prefill chunk knows only its own end
        self._buffers(layer, 0 if layer.static else self.n_clusters)

    def prepare_step(self, layer) -> None:
        """Nothing per token: a new key stays unclustered (``assign`` -1, read exactly) until its batch is
        clustered by :meth:`maintain`. (A growing cache grows ``assign`` with it first.)"""
        if not layer.static:
            self._buffers(layer, layer.meta.get("num_clusters", self.n_clusters))

    def maintain(self, layer, written: int) -> None:
        """Cluster the prompt once (before the first decode step reads it), then every ``recluster_every`` new
        tokens the keys not clustered yet, into ``new_clusters`` clusters (host-side, between steps)."""
        meta = layer.meta
        if "num_clusters" not in meta:
            if layer.static:
                # every slot the generation will fill, from the whole prompt (sized at the first prefill chunk, a
                # 127K prompt in chunks of 4K got ~3,500 slots for ~400 clusters, each scored and ranked every step)
                self._buffers(layer, self._scheduled_clusters(layer, written))
            self._cluster(layer, 0, written, self.n_clusters)
        elif written - meta["clustered_upto_host"] >= self.recluster_every:
            self._cluster(layer, meta["clustered_upto_host"], written, self.new_clusters)

    def select(self, layer, query: torch.Tensor) -> Selection:
        meta = layer.meta
        sizes, clustered_upto = meta["sizes"], meta["clustered_upto"]
        scores = cluster_scores(query, meta["centroids"], sizes.shape[2])
        taken = cluster_take(scores, sizes, layer.kv_start, layer.kv_end, clustered_upto, self.budget, self.n_sink)
        mask = cluster_token_mask(meta["assign"], taken, layer.kv_start, layer.kv_end, clustered_upto, self.budget,
                                  self.n_sink)
        return mask_to_selection(mask, self.budget)
