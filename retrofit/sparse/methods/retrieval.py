"""RetrievalAttention (Liu et al., 2409.10516): approximate nearest-neighbour search over the keys (faiss).

Per (batch, kv head) one faiss index (inner product) holds the keys between the sinks and the local window; each
decode step searches it with the query (GQA: the group's queries averaged, or each head searched and the hits
merged by score) for ``budget - n_sink - window`` keys; sinks and window are always read exactly. Keys leaving the
window are added to the index. faiss-gpu is used when it sees a GPU (``device="auto"``), faiss-cpu otherwise.

Not capturable: the search runs in faiss on the host, so a decode step cannot be recorded as a CUDA graph and runs
eagerly. What a step costs on top of the other methods, per sparse layer: the query copied to the host and the hits
copied back (the first a device synchronisation), and the key leaving the window copied to the host for the index,
plus ``B x Hkv`` faiss searches; the positions are host-known, so nothing else reads the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from retrofit.errors import RetrofitError
from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import mask_to_selection

QUERY_POOLING = ("mean", "union")


def import_faiss():
    """The faiss module, or a RetrofitError saying how to install it."""
    try:
        import faiss
    except ImportError:
        raise RetrofitError(
            "sparse method 'retrieval' needs faiss: pip install faiss-cpu (or faiss-gpu-cu12 on a CUDA machine)"
        ) from None
    return faiss


@register("retrieval")
@dataclass
class RetrievalAttention(SparseMethod):
    """Not ``capturable`` (the faiss search runs on the host: see the module docstring). ``index``: a faiss factory string ("Flat", "HNSW32", "IVF256,Flat", ...); ``nprobe``/``ef_search``: search
    parameters of IVF/HNSW indexes; ``query``: "mean" or "union" over the GQA group; ``device``: auto|cpu|gpu."""

    n_sink: int = 4
    window: int = 64
    index: str = "Flat"
    nprobe: int | None = None
    ef_search: int | None = None
    query: str = "mean"
    device: str = "auto"
    capturable = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._faiss = import_faiss()
        require(isinstance(self.n_sink, int) and self.n_sink >= 0, "n_sink", self.n_sink, "a non-negative integer")
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window, "a positive integer")
        require(self.n_sink + self.window < self.budget, "budget", self.budget,
                f"more than n_sink + window = {self.n_sink + self.window}")
        require(self.query in QUERY_POOLING, "query", self.query, f"one of {', '.join(QUERY_POOLING)}")
        require(self.device in ("auto", "cpu", "gpu"), "device", self.device, "auto, cpu or gpu")
        for field in ("nprobe", "ef_search"):
            value = getattr(self, field)
            require(value is None or (isinstance(value, int) and value > 0), field, value, "a positive integer")
        try:
            self._faiss.index_factory(8, self.index, self._faiss.METRIC_INNER_PRODUCT)
        except RuntimeError:
            require(False, "index", self.index, "a faiss index_factory string such as Flat, HNSW32 or IVF64,Flat")
        if self.device == "gpu" and self._gpus() == 0:
            raise RetrofitError("sparse method 'retrieval' with device=gpu: faiss sees no GPU (install faiss-gpu-cu12)")

    def _gpus(self) -> int:
        return self._faiss.get_num_gpus() if hasattr(self._faiss, "get_num_gpus") else 0

    @property
    def k_search(self) -> int:
        return self.budget - self.n_sink - self.window

    def _new_index(self, dim: int, train: np.ndarray):
        faiss = self._faiss
        index = faiss.index_factory(dim, self.index, faiss.METRIC_INNER_PRODUCT)
        if not index.is_trained:
            if len(train) == 0:
                raise RetrofitError(f"faiss index {self.index!r} needs training data: the prompt is too short")
            try:
                index.train(train)
            except RuntimeError as error:
                raise RetrofitError(f"faiss index {self.index!r} could not be trained on {len(train)} keys: "
                                    f"{str(error).splitlines()[0]}") from None
        params = faiss.ParameterSpace()
        if self.nprobe is not None:
            params.set_index_parameter(index, "nprobe", self.nprobe)
        if self.ef_search is not None:
            params.set_index_parameter(index, "efSearch", self.ef_search)
        if self.device == "gpu" or (self.device == "auto" and self._gpus() > 0 and "HNSW" not in self.index):
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        return index

    def _bounds(self, layer) -> tuple[list[int], list[int]]:
        """Per row, on the host: first indexed position (after the sinks) and first window position."""
        n = layer.length
        sink_end = [min(start + self.n_sink, n) for start in layer.kv_start_host]
        return sink_end, [max(end, n - self.window) for end in sink_end]

    def prepare(self, layer, start: int, end: int) -> None:
        meta = layer.meta
        B, H, _, D = layer.keys.shape
        sink_end, window_start = self._bounds(layer)
        if "indexes" not in meta:
            keys = layer.keys[:, :, : layer.length].float().cpu().numpy()
            meta["indexes"] = [[self._new_index(D, keys[b, h, sink_end[b] : window_start[b]])
                                for h in range(H)] for b in range(B)]
            meta["indexed_upto"] = list(sink_end)
        upto = meta["indexed_upto"]
        for b in range(B):
            lo, hi = upto[b], window_start[b]
            if hi > lo:
                chunk = layer.keys[b, :, lo:hi].float().cpu().numpy()
                for h in range(H):
                    meta["indexes"][b][h].add(np.ascontiguousarray(chunk[h]))
                upto[b] = hi

    def select(self, layer, query: torch.Tensor) -> Selection:
        meta = layer.meta
        B, H = layer.keys.shape[:2]
        n = layer.length
        _, window_start = self._bounds(layer)
        pos = torch.arange(n, device=layer.keys.device)
        start = torch.tensor(layer.kv_start_host, device=pos.device)[:, None]
        window = torch.tensor(window_start, device=pos.device)[:, None]
        keep = ((pos >= start) & (pos < start + self.n_sink)) | (pos >= window)
        keep = keep[:, None, :].expand(B, H, n).clone()
        queries = query.float().view(B, H, -1, query.shape[-1]).cpu().numpy()
        base = [row + self.n_sink for row in layer.kv_start_host]
        hits = torch.zeros(B, H, n, dtype=torch.bool)
        for b in range(B):
            for h in range(H):
                index = meta["indexes"][b][h]
                if index.ntotal == 0:
                    continue
                k = min(self.k_search, index.ntotal)
                if self.query == "mean":
                    _, ids = index.search(np.ascontiguousarray(queries[b, h].mean(0, keepdims=True)), k)
                    ids = ids[0]
                else:
                    scores, ids = index.search(np.ascontiguousarray(queries[b, h]), k)
                    order = np.argsort(-scores.ravel(), kind="stable")
                    ids = ids.ravel()[order]
                    ids = ids[ids >= 0]
                    _, first = np.unique(ids, return_index=True)
                    ids = ids[np.sort(first)][:k]
                ids = ids[ids >= 0]
                hits[b, h, torch.from_numpy(ids + base[b])] = True
        return mask_to_selection(keep | hits.to(keep.device), self.budget)

    def metadata_bytes(self, layer) -> dict[str, int]:
        indexes = layer.meta.get("indexes") or []
        size = 0
        for row in indexes:
            for index in row:
                try:
                    size += self._faiss.serialize_index(index).nbytes
                except RuntimeError:  # GPU index: count the stored vectors
                    size += index.ntotal * index.d * 4
        return {"index": size}
