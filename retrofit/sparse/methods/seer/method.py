"""SeerAttention decode gates (Gao et al., 2410.13276; SeerAttention-R 2506.08889): a small learned gate scores
blocks of the KV cache from block-pooled keys; the top blocks are read.

Gate of one layer (weights shared by its kv heads): ``gq = Wq . concat(queries of the GQA group)``,
``gk = Wk . concat(max, min, mean of the block's keys)``, ``score = gq . gk / sqrt(hidden)``. The base model stays
frozen; the gates are trained by ``retrofit gates`` (KL to the block-pooled dense attention) and loaded from a file.
Per decode step: top ``budget // block_size`` blocks, the block holding the newest token always among them. The gate
keys cover every block of the buffer; a decode step updates the newest block's gate key in place and scores every
block (blocks without a valid position of a row score -inf): fixed shapes, no host read, so the step can be captured.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from retrofit.atomic import torch_load, torch_save
from retrofit.errors import RetrofitError
from retrofit.kernels.sparse_decode import cluster_scores, pool_blocks, seer_gate_key_update
from retrofit.sparse.contract import Selection, SparseMethod, require
from retrofit.sparse.registry import register
from retrofit.sparse.methods.common import best_blocks, blocks_written, full_counts, grown

GATE_FORMAT = "retrofit-seer-gates"
RANDOM_GATE_BLOCK = 64


class SeerGate(nn.Module):
    """One layer's decode gate: q [B, Hq, D] -> [B, Hkv, hidden]; pooled block keys [B, Hkv, NB, 3D] -> [B, Hkv, NB, hidden]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, hidden: int = 128):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.hidden = hidden
        self.q_proj = nn.Linear(self.group * head_dim, hidden, bias=False)
        self.k_proj = nn.Linear(3 * head_dim, hidden, bias=False)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.hidden)

    def projected_query(self, q: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hkv, hidden] before the gate's scale (the decode step's scoring kernel applies it)."""
        B, _, D = q.shape
        return self.q_proj(q.reshape(B, self.num_kv_heads, self.group * D))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        return self.projected_query(q) * self.scale

    def block_keys(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.k_proj(pooled)

    def scores(self, q: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], pooled [B, Hkv, NB, 3D] -> block logits [B, Hkv, NB]."""
        return torch.einsum("bhc,bhnc->bhn", self.query(q), self.block_keys(pooled))


class SeerGates(nn.Module):
    """The gates of a model (layer index -> SeerGate) with their block size; saved/loaded as one file."""

    def __init__(self, layers: list[int], num_heads: int, num_kv_heads: int, head_dim: int, hidden: int = 128,
                 block_size: int = 64):
        super().__init__()
        self.config = dict(layers=list(layers), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           hidden=hidden, block_size=block_size)
        self.block_size = block_size
        self.gates = nn.ModuleDict({str(i): SeerGate(num_heads, num_kv_heads, head_dim, hidden) for i in layers})

    def __contains__(self, layer_idx: int) -> bool:
        return str(layer_idx) in self.gates

    def __getitem__(self, layer_idx: int) -> SeerGate:
        return self.gates[str(layer_idx)]

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file, then rename)."""
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        torch_save({"format": GATE_FORMAT, "version": 1, "config": self.config, "state_dict": state}, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SeerGates":
        path = Path(path)
        if not path.is_file():
            raise RetrofitError(f"seer gate file {str(path)!r} does not exist (train one with `retrofit gates`)")
        payload = torch_load(path, "seer gates")
        if not isinstance(payload, dict) or payload.get("format") != GATE_FORMAT:
            raise RetrofitError(f"{str(path)!r} is not a retrofit seer gate file")
        gates = cls(**payload["config"])
        gates.load_state_dict(payload["state_dict"])
        return gates.eval().requires_grad_(False)


@register("seer")
@dataclass
class SeerAttention(SparseMethod):
    """``gate_path``: gate file from ``retrofit gates``; blocks of the file's block size (at most ``budget``).
    ``random_gates=true`` instead builds untrained gates of the right shape for the model (blocks of 64, hidden 128,
    the authors' decode gate): for speed and memory runs on random-weight configs, where no gate was trained."""

    gate_path: str | None = None
    random_gates: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self._placed: dict[tuple, SeerGates] = {}
        if self.random_gates:
            require(self.gate_path is None, "gate_path", self.gate_path, "none with random_gates=true")
            self._gates: SeerGates | None = None
            require(self.budget >= RANDOM_GATE_BLOCK, "budget", self.budget,
                    f"at least the gate block size {RANDOM_GATE_BLOCK}")
            return
        require(self.gate_path is not None and str(self.gate_path) != "", "gate_path", self.gate_path,
                "a gate file trained by `retrofit gates MODEL --out PATH` (or random_gates=true)")
        self._gates = SeerGates.load(self.gate_path)
        require(self.budget >= self._gates.block_size, "budget", self.budget,
                f"at least the gate block size {self._gates.block_size}")

    def bind(self, config) -> None:
        if self.random_gates:
            from retrofit import architecture

            arch = architecture.of(config)
            layers = list(range(config.num_hidden_layers))
            with torch.random.fork_rng(devices=[]):  # untrained but reproducible, and the caller's RNG untouched
                torch.manual_seed(0)
                self._gates = SeerGates(layers, arch.num_heads(config), arch.num_kv_heads(config),
                                        arch.head_dim(config), hidden=128, block_size=RANDOM_GATE_BLOCK)
            self._gates.eval().requires_grad_(False)

    @property
    def block_size(self) -> int:
        return self._gates.block_size

    def _gate(self, layer, like: torch.Tensor) -> SeerGate | None:
        if layer.layer_idx not in self._gates:
            return None
        key = (like.device, like.dtype)
        if key not in self._placed:
            config = self._gates.config
            B, H, _, D = layer.keys.shape
            if (H, D) != (config["num_kv_heads"], config["head_dim"]):
                raise RetrofitError(f"seer gate file {self.gate_path!r} was trained for {config['num_kv_heads']} kv "
                                    f"heads of dim {config['head_dim']}, the model has {H} of dim {D}")
            placed = SeerGates(**config).to(device=like.device, dtype=like.dtype).eval().requires_grad_(False)
            placed.load_state_dict(self._gates.state_dict())
            self._placed[key] = placed
        return self._placed[key][layer.layer_idx]

    def keeps_dense(self, layer) -> bool:
        return layer.layer_idx not in self._gates

    def _gate_keys(self, layer, gate: SeerGate) -> torch.Tensor:
        """[B, Hkv, NB, hidden] gate keys of the NB blocks of the buffer (grown with a growing cache)."""
        B, H = layer.keys.shape[:2]
        blocks = -(-layer.capacity // self.block_size)
        layer.meta["gate_keys"] = grown(layer.meta.get("gate_keys"), 2, blocks, layer.keys, (B, H, 0, gate.hidden))
        return layer.meta["gate_keys"]

    def prepare(self, layer, start: int, end: int) -> None:
        gate = self._gate(layer, layer.keys)
        if gate is None or end <= start:
            return
        gate_keys = self._gate_keys(layer, gate)
        blocks, span, valid = blocks_written(layer, start, end, self.block_size)
        with torch.no_grad():
            gate_keys[:, :, blocks] = gate.block_keys(pool_blocks(span, valid, self.block_size).to(layer.keys.dtype))

    def prepare_step(self, layer) -> None:
        """The gate key of the block of the token just written at ``write_pos - 1``, again, on the device."""
        gate = self._gate(layer, layer.keys)
        if gate is None:
            return
        seer_gate_key_update(layer.keys, self._gate_keys(layer, gate), gate.k_proj.weight, layer.write_pos,
                             layer.kv_start, layer.kv_end, self.block_size)

    def select(self, layer, query: torch.Tensor) -> Selection | None:
        gate = self._gate(layer, query)
        if gate is None:
            return None
        gate_keys = layer.meta["gate_keys"]
        blocks = -(-layer.capacity // self.block_size)
        with torch.no_grad():
            gate_query = gate.projected_query(query).contiguous()
        scores = cluster_scores(gate_query, gate_keys, blocks, scale=gate.scale)
        top = best_blocks(layer, scores, min(self.budget // self.block_size, blocks), self.block_size)
        return Selection(top, full_counts(layer, top), self.block_size)
