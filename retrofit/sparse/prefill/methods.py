"""Training-free sparse prefill methods: which key blocks each query block of a head computes.

A method is a small dataclass (:class:`PrefillMethod`) with one abstract method, ``block_mass``: a cheap estimate of
the share of each query block's attention that falls in each key block. The shared part (:mod:`.blocks`) keeps the
sink and local blocks and adds blocks until ``threshold`` of the estimated attention is covered. Registered by name
in :data:`PREFILL_METHODS`:

- ``xattention`` (XAttention, Xu et al. 2025, 2503.16428): the sum of each ``stride x stride`` tile's antidiagonal of
  ``q . k`` as one strided logit, softmax over the strided row, summed per block;
- ``vertical_slash`` (MInference, Jiang et al. 2024, 2407.02490): the attention of the chunk's last queries,
  summed per key (vertical lines) and per query-key distance (slash lines), spread over the blocks those lines cross.
"""
from __future__ import annotations

import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from retrofit.cliargs import coerce
from retrofit.errors import RetrofitError
from retrofit.kernels.sparse_prefill import antidiagonal_block_mass
from retrofit.prefill_defaults import DEFAULT_MIN_LENGTH, MIN_LENGTH_HELP  # noqa: F401  (re-exported)
from retrofit.registry import Registry
from retrofit.sparse.prefill.blocks import BlockGrid, choose_blocks

PREFILL_METHODS: Registry[type["PrefillMethod"]] = Registry("sparse prefill method")
PARAMETER = "sparse prefill parameter"


def register(name: str):
    """Class decorator: register a PrefillMethod subclass under ``name``."""

    def add(cls):
        cls.name = name
        return PREFILL_METHODS.register(name)(cls)

    return add


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """A one-line RetrofitError naming the field when a parameter is invalid."""
    if not ok:
        raise RetrofitError(f"{PARAMETER} {field}={value!r} is invalid: expected {expected}")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PrefillMethod(ABC):
    """Base of every sparse prefill method.

    ``threshold``: the share of the estimated attention of each query block the computed blocks must hold (1.0:
    every causal block, dense attention in what it returns); ``block_size``: positions per block (a power of two,
    at least 16); ``sink_blocks``: blocks from each row's first real token always computed (attention sinks);
    ``local_blocks``: blocks ending at the query block's own always computed (the diagonal and the ones before it);
    ``last_query_blocks``: the call's last query blocks computed over every causal key block (the prompt's last
    position is the one the first generated token is read from; decoding attends to every key), in the call that
    ends the prompt only (``BlockGrid.ends_prompt``: retrofit's engine marks the chunks that more follow);
    ``max_density``: at most this share of the causal blocks per query block (the sinks and local blocks always),
    e.g. to time a fixed density on random weights; ``min_length``: a call over fewer keys runs dense attention
    (default :data:`DEFAULT_MIN_LENGTH`, from a measurement: see :mod:`retrofit.prefill_defaults`).
    """

    threshold: float = 0.9
    block_size: int = 128
    sink_blocks: int = 1
    local_blocks: int = 2
    last_query_blocks: int = 1
    max_density: float = 1.0
    min_length: int = DEFAULT_MIN_LENGTH
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        require(isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool)
                and 0 < self.threshold <= 1, "threshold", self.threshold, "a share in (0, 1]")
        require(_integer(self.block_size) and self.block_size >= 16 and self.block_size & (self.block_size - 1) == 0,
                "block_size", self.block_size, "a power of two of at least 16")
        require(_integer(self.sink_blocks) and self.sink_blocks >= 0, "sink_blocks", self.sink_blocks,
                "a number of blocks >= 0")
        require(_integer(self.local_blocks) and self.local_blocks >= 1, "local_blocks", self.local_blocks,
                "a number of blocks >= 1 (the diagonal block holds each query's own key)")
        require(_integer(self.last_query_blocks) and self.last_query_blocks >= 0, "last_query_blocks",
                self.last_query_blocks, "a number of query blocks >= 0")
        require(isinstance(self.max_density, (int, float)) and not isinstance(self.max_density, bool)
                and 0 < self.max_density <= 1, "max_density", self.max_density, "a share in (0, 1]")
        require(_integer(self.min_length) and self.min_length >= 0, "min_length", self.min_length,
                "a number of keys >= 0")

    @property
    def keeps_every_block(self) -> bool:
        return self.threshold >= 1 and self.max_density >= 1

    @abstractmethod
    def block_mass(self, query: torch.Tensor, key: torch.Tensor, grid: BlockGrid, scale: float) -> torch.Tensor:
        """The estimated share of each query block's attention in each key block: query [B, Hq, T, D] (rotated, as
        the attention receives it), key [B, Hkv, N, D] -> [B, Hq, grid.rows, grid.key_blocks] fp32, each row summing
        to 1 over its causal blocks (or 0 where it has none); values outside the causal blocks are ignored."""

    def choose(self, query: torch.Tensor, key: torch.Tensor, grid: BlockGrid, scale: float) -> torch.Tensor:
        """The blocks to compute: [B, Hq, grid.rows, grid.key_blocks] bool (see :func:`.blocks.choose_blocks`)."""
        causal = grid.causal()
        kept = grid.kept(self.sink_blocks, self.local_blocks, self.last_query_blocks)
        B, Hq = query.shape[:2]
        if self.keeps_every_block:
            return causal.expand(B, Hq, grid.rows, grid.key_blocks).clone()
        mass = self.block_mass(query, key, grid, scale)
        return choose_blocks(mass, causal, kept, self.threshold, self.max_density)


@register("xattention")
@dataclass
class XAttention(PrefillMethod):
    """XAttention's antidiagonal scoring. ``stride`` S (a divisor of ``block_size``): positions are grouped in runs
    of S; the strided logit of query run ``r`` and key run ``c`` is ``sum_j q[rS + S-1-j] . k[cS + j]`` (the tile's
    antidiagonal) times ``scale / S``; a softmax over the causal runs of each query run, summed over the runs of
    each block pair and normalised per query block, is the block mass. Costs about ``1 / S`` of the attention's
    ``q . k`` products (authors: S = 8 or 16 at blocks of 128, threshold 0.9), twice on CUDA, where one fused kernel
    (``retrofit.kernels.sparse_prefill.antidiagonal_block_mass``) recomputes them rather than store the logits."""

    stride: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        require(_integer(self.stride) and self.stride >= 1 and self.block_size % self.stride == 0, "stride",
                self.stride, f"a divisor of block_size={self.block_size}")

    def runs(self, query: torch.Tensor, key: torch.Tensor, grid: BlockGrid) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimate's operands: query [B, Hq, T, D], key [B, Hkv, N, D] -> query runs [B, Hq, grid.rows * bs / S,
        S * D] (each run read backwards, so that a run's product with a key run is their antidiagonal) and key runs
        [B, Hkv, grid.key_blocks * bs / S, S * D], over whole blocks: positions outside the chunk, before a row's
        ``kv_start`` or past the keys are zero."""
        B, Hq, T, D = query.shape
        Hkv, N = key.shape[1], key.shape[2]
        S, bs = self.stride, grid.block_size
        start = grid.kv_start
        first = grid.first_block * bs
        positions = torch.arange(first, first + grid.rows * bs, device=query.device)
        inside = (positions >= grid.q_offset) & (positions < grid.q_offset + T)
        queries = query.new_zeros(B, Hq, grid.rows * bs, D)
        queries[:, :, inside] = query
        queries = queries.masked_fill((positions[None, :] < start[:, None])[:, None, :, None], 0)
        keys = key.new_zeros(B, Hkv, grid.key_blocks * bs, D)
        keys[:, :, :N] = key
        key_positions = torch.arange(grid.key_blocks * bs, device=query.device)
        keys = keys.masked_fill((key_positions[None, :] < start[:, None])[:, None, :, None], 0)
        runs_q = queries.view(B, Hq, -1, S, D).flip(3).reshape(B, Hq, -1, S * D)
        runs_k = keys.view(B, Hkv, -1, S * D)
        return runs_q, runs_k

    def block_mass(self, query, key, grid, scale):
        S, bs = self.stride, grid.block_size
        runs_q, runs_k = self.runs(query, key, grid)
        mass = antidiagonal_block_mass(runs_q, runs_k, grid.kv_start, bs // S, S, grid.first_block * bs // S,
                                       grid.q_offset, query.shape[2], scale / S)
        return _normalised(mass)


@register("vertical_slash")
@dataclass
class VerticalSlash(PrefillMethod):
    """MInference's vertical-slash estimate, at block granularity. The chunk's ``last_queries`` queries attend over
    every key (causal, padding masked); their attention summed per key is the *vertical* profile ``v[k]`` and summed
    per distance ``o = q - k`` the *slash* profile ``s[o]``. Every query block is assumed to share both: key block
    ``n`` holds ``sum_{k in n} v[k]`` of a query block's vertical mass and, for ``d = m - n`` blocks below the
    diagonal, ``sum_o s[o] * max(0, 1 - |o - d * block_size| / block_size)`` of its slash mass (the share of the
    block's cells on distance ``o``); the block mass is the mean of the two, each normalised over the row's causal
    blocks. Costs ``last_queries / T`` of the attention's products (authors: 64 last queries)."""

    last_queries: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        require(_integer(self.last_queries) and self.last_queries >= 1, "last_queries", self.last_queries,
                "a number of queries >= 1")

    def block_mass(self, query, key, grid, scale):
        B, Hq, T, D = query.shape
        Hkv, N = key.shape[1], key.shape[2]
        group, bs = Hq // Hkv, grid.block_size
        last = min(self.last_queries, T)
        positions = torch.arange(grid.q_offset + T - last, grid.q_offset + T, device=query.device)  # [last]
        keys = torch.arange(N, device=query.device)
        visible = (keys[None, None, :] <= positions[None, :, None]) \
            & (keys[None, None, :] >= grid.kv_start[:, None, None])  # [B, last, N]
        logits = torch.einsum("bhgqd,bhnd->bhgqn", query[:, :, T - last:].float().reshape(B, Hkv, group, last, D),
                              key.float()).reshape(B, Hq, last, N) * scale
        weights = torch.softmax(logits.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num(0.0)
        vertical = weights.sum(2)  # [B, Hq, N]
        distance = (positions[:, None] - keys[None, :])  # [last, N]: o = q - k for k at index o of the row
        by_distance = weights.gather(-1, (positions[:, None] - keys[None, :]).clamp_min(0).expand(B, Hq, last, N))
        slash = by_distance.masked_fill((distance < 0)[None, None], 0.0).sum(2)  # [B, Hq, N] over o = 0..N-1
        vertical_blocks = torch.nn.functional.pad(vertical, (0, grid.key_blocks * bs - N)).view(
            B, Hq, grid.key_blocks, bs).sum(-1)
        share = 1 - torch.arange(1 - bs, bs, device=query.device).abs().float() / bs  # cells per distance, per row
        padded = torch.nn.functional.pad(slash, (bs - 1, (grid.key_blocks + 1) * bs - N))
        slash_blocks = (padded.unfold(-1, 2 * bs - 1, bs)[..., : grid.key_blocks, :] * share).sum(-1)  # [B, Hq, d]
        m = torch.arange(grid.first_block, grid.first_block + grid.rows, device=query.device)[:, None]
        n = torch.arange(grid.key_blocks, device=query.device)[None, :]
        causal = grid.causal()
        vertical_mass = torch.where(causal, vertical_blocks[:, :, None, :], 0.0)
        slash_mass = torch.where(causal, slash_blocks[:, :, (m - n).clamp_min(0)], 0.0)
        return 0.5 * (_normalised(vertical_mass) + _normalised(slash_mass))


def _normalised(mass: torch.Tensor) -> torch.Tensor:
    """Each row of ``mass [..., nK]`` over its sum (rows summing to 0 stay 0)."""
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)


def build_prefill_method(name: str, **params: Any) -> PrefillMethod:
    """Construct a registered prefill method; string values (from the CLI) are converted by its field types."""
    cls = PREFILL_METHODS.get(name)
    hints = typing.get_type_hints(cls)
    known = {f.name: hints[f.name] for f in fields(cls)}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise RetrofitError(f"unknown parameter {unknown[0]!r} for sparse prefill method {name!r}; it takes: "
                            f"{', '.join(sorted(known))}")
    return cls(**{key: coerce(value, known[key], key, PARAMETER) for key, value in params.items()})
