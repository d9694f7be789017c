"""The decode engine: a static cache, a chunked prefill, then decode steps that touch only device tensors.

One :class:`StaticGeneration` runs one batch: it preallocates the cache for prompt + new tokens (rounded up to a
cache-length bucket of :data:`CAPACITY_QUANTUM` positions), prefills the prompt in chunks, and then runs decode
steps. A decode step (:meth:`StaticGeneration.step`) reads and writes only tensors that exist before it starts and
keep their addresses (the cache, the last tokens, the positions, the output buffer, the finished flags): no
``.item()``, ``nonzero`` or Python branch on a tensor value, no cache tensor allocated, and the same sequence of
operations every step. That is what lets CUDA capture the whole step (every layer and the sampling) once as a graph
and replay it (:mod:`retrofit.generation.graphs`); on the CPU the same code runs eagerly. The host looks at the
device at most once every ``stop_check_every`` tokens (have all rows finished? which tokens to stream?).

Attention: the engine runs the model's softmax layers through its own attention function while it works. Prefill
chunks run the model's own implementation (SDPA, eager, ...) over the positions written so far, with transformers'
masks (block-sparse where a ``retrofit.sparse_prefill`` is open on the model: ``prefill_or_dense``). A decode token attends over the static buffer through ``retrofit.kernels.sparse_decode_attention`` with a
selection of every block (the kernel reads only each row's valid positions ``[row_start, written)``; GQA reads each
key once per group); where the kernels run their PyTorch paths (the CPU), through SDPA with the mask of that range. Inside ``retrofit.sparse_decoding`` the session's layers go to the session, which selects.

Decoder layers: where the kernels run on Triton (CUDA by default), a decode step runs the supported layers (Llama,
Mistral, Qwen2) through their fused forward (:mod:`retrofit.generation.fused_layers`: fused norms, MLP activation,
rotation and cache write, q/k/v as one GEMM; 11 kernels per layer instead of 40); prefill chunks run the model's own
layers. ``fuse_layers=False`` keeps the model's own layers for decode too (the baseline of ``retrofit bench --engine
retrofit-unfused``). At Llama-3-8B shapes the fused step is 1.35x faster at 4K x 1 (BENCHMARKS.md, Current figures >
End-to-end generation).
"""
from __future__ import annotations

import math
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import StaticCache

from retrofit.errors import RetrofitError
from retrofit.generation.fused_layers import DecodeFusion
from retrofit.generation.inputs import cache_keyword
from retrofit.generation.sampling import TokenChooser
from retrofit.kernels import backend_for
from retrofit.kernels.sparse_decode import sparse_decode_attention
from retrofit.model_info import attention_layout
from retrofit.sparse.attention_functions import attention_function, mask_function_of
from retrofit.sparse.cache import SparseLayer
from retrofit.sparse.patch import SparseSession, active_session
from retrofit.sparse.prefill.patch import own_implementation, prefill_or_dense, prompt_continues
from retrofit.static_cache import RingLayer, ring_selection, static_layers

CAPACITY_QUANTUM = 256  # cache lengths are rounded up to a multiple of this: one graph per bucket, not per length
DENSE_BLOCK = 64  # block size of the all-blocks selection a dense decode step reads (a divisor of the quantum)
DEFAULT_PREFILL_CHUNK = 4096
DEFAULT_STOP_CHECK_EVERY = 16


def cache_capacity(tokens: int) -> int:
    """Positions a static cache is allocated with for ``tokens`` (prompt + new): the next multiple of the quantum."""
    return CAPACITY_QUANTUM * math.ceil(tokens / CAPACITY_QUANTUM)


def text_config(model):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


@dataclass
class AllBlocks:
    """The selection of every block of a static buffer, for a dense decode step: ``indices [B, Hkv, C / block]``
    int32, ``counts [B, Hkv]`` int32 (built once; the kernel skips positions outside each row's valid range)."""

    indices: torch.Tensor
    counts: torch.Tensor
    block_size: int

    @classmethod
    def of(cls, keys: torch.Tensor, block_size: int = DENSE_BLOCK) -> "AllBlocks":
        B, H, capacity, _ = keys.shape
        blocks = capacity // block_size
        indices = torch.arange(blocks, device=keys.device, dtype=torch.int32).expand(B, H, blocks).contiguous()
        return cls(indices, torch.full((B, H), blocks, device=keys.device, dtype=torch.int32), block_size)


class StaticGeneration:
    """One batch of generation over a static cache (see the module docstring).

    ``input_ids [B, T]`` / ``attention_mask [B, T]`` (left-padded, checked by the caller), ``max_new_tokens`` N,
    ``chooser`` (greedy or sampling), ``eos`` and ``pad`` token ids. Attributes after :meth:`prefill`: ``out [B, C]``
    (C the cache capacity; the new tokens in its first N columns, ``pad`` after a row's end), ``finished_at [B]``
    (index of each row's end token, N if none). ``fuse_layers`` (default on): decode steps run the supported decoder
    layers fused where the kernels run on Triton (see the module docstring; off: ``retrofit bench --engine
    retrofit-unfused``).
    """

    def __init__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 chooser: TokenChooser, eos: list[int], pad: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 fuse_layers: bool = True):
        if prefill_chunk <= 0:
            raise RetrofitError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
        self.model = model
        self.batch = input_ids.shape[0]
        self.chooser, self.pad, self.prefill_chunk = chooser, pad, prefill_chunk
        self.device = input_ids.device
        self.session: SparseSession | None = active_session(model)
        self.capacity = cache_capacity(input_ids.shape[1] + max_new_tokens)
        self.layout = attention_layout(model)
        self.cache = self._new_cache()
        self.cache_argument = cache_keyword(model)
        self.implementation = (self.session.original_implementation if self.session is not None
                               else own_implementation(model))
        self.base_mask = mask_function_of(model)
        self.all_blocks: AllBlocks | None = None
        self.positions_of_buffer: torch.Tensor | None = None
        self.ring_offsets: dict[int, torch.Tensor] = {}  # ring size -> arange(size) on the device
        self.fuse_layers = fuse_layers
        self.fusion: DecodeFusion | None = None  # the fused decoder layers, while installed on the Triton backend
        # the device state a decode step reads and updates in place; sized by the cache's capacity, not by this
        # batch's prompt, so that :meth:`load` can put another batch of the same bucket into the same tensors
        device, B = self.device, self.batch
        self.row_start = torch.zeros(B, dtype=torch.int32, device=device)
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, 1, dtype=torch.long, device=device)  # each row's next position (real tokens)
        self.out = torch.full((B, self.capacity), pad, dtype=torch.long, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.finished_at = torch.zeros(B, dtype=torch.long, device=device)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device)
        self._load_rows(input_ids, attention_mask, max_new_tokens)

    def _load_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> None:
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.prompt_length = input_ids.shape[1]
        self.max_new_tokens = max_new_tokens
        real_tokens = attention_mask.sum(-1, keepdim=True)  # [B, 1]
        self.positions.copy_(real_tokens)
        self.row_start.copy_(self.prompt_length - real_tokens[:, 0])
        self.tokens.zero_()
        self.out.fill_(self.pad)
        self.step_index.zero_()
        self.finished.zero_()
        self.finished_at.fill_(max_new_tokens)
        self.steps_done = 0  # decode steps run (host count: the engine drives every step)
        self.chunk_start = self.chunk_end = 0

    def can_load(self, input_ids: torch.Tensor, max_new_tokens: int) -> bool:
        """Whether another batch fits this generation's tensors: the same batch size, device and cache bucket."""
        return (input_ids.shape[0] == self.batch and input_ids.device == self.device
                and cache_capacity(input_ids.shape[1] + max_new_tokens) == self.capacity)

    def load(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> None:
        """Make this generation run another batch (``can_load`` must hold): the cache emptied and every device
        tensor of the step rewritten in place, so that a decode step captured for the previous batch replays
        correctly for this one."""
        if not self.can_load(input_ids, max_new_tokens):
            raise RetrofitError(f"a batch of {tuple(input_ids.shape)} + {max_new_tokens} new tokens does not fit a "
                                f"generation of batch {self.batch} and capacity {self.capacity}")
        self.cache.reset()
        self._load_rows(input_ids, attention_mask, max_new_tokens)

    def _new_cache(self):
        if self.session is not None:
            return self.session.new_cache(capacity=self.capacity)
        cache = StaticCache(config=text_config(self.model), max_cache_len=self.capacity)
        cache.layers = static_layers(self.model, self.capacity)
        return cache

    # -- the attention and mask functions the model runs while the engine works ----------------------------------
    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """transformers' attention interface: query ``[B, Hq, T, D]``, key/value the layer's cache buffers ->
        (``[B, T, Hq, D]``, None)."""
        layer = self.cache.layers[module.layer_idx]
        if isinstance(layer, SparseLayer):
            return self.session.attention(module, query, key, value, attention_mask, **kwargs)
        if query.shape[2] > 1:
            if isinstance(layer, RingLayer):  # the ring's keys [kv_offset, chunk_end): those columns of the mask
                if attention_mask is not None:
                    attention_mask = attention_mask[..., layer.kv_offset: self.chunk_end]
                return prefill_or_dense(self.model, self.implementation, module, query, key, value, attention_mask,
                                        **kwargs)
            end = self.chunk_end
            return prefill_or_dense(self.model, self.implementation, module, query, key[:, :, :end],
                                    value[:, :, :end], attention_mask, **kwargs)
        softcap = self.layout.layers[module.layer_idx].softcap
        if isinstance(layer, RingLayer):
            return self.ring_decode_attention(layer, query[:, :, 0], kwargs.get("scaling"), softcap)[:, None], None
        written = layer.cumulative_length  # device counter of the layer: no host read
        if backend_for(query.device) == "torch" and softcap is None:  # PyTorch: SDPA over the valid range
            return self._sdpa_decode(layer, query, written, kwargs.get("scaling")), None
        return self.static_decode_attention(layer, query[:, :, 0], kwargs.get("scaling"), softcap)[:, None], None

    def static_decode_attention(self, layer, query: torch.Tensor, scale: float | None,
                                softcap: float | None = None) -> torch.Tensor:
        """query ``[B, Hq, D]`` over a static layer's valid positions ``[row_start, written)`` through
        ``sparse_decode_attention`` (a selection of every block) -> ``[B, Hq, D]``."""
        if self.all_blocks is None:
            self.all_blocks = AllBlocks.of(layer.keys)
        blocks = self.all_blocks
        return sparse_decode_attention(query, layer.keys, layer.values, blocks.indices, blocks.counts,
                                       self.row_start, layer.cumulative_length.expand(self.batch),
                                       block_size=blocks.block_size, scale=scale, softcap=softcap)

    def ring_decode_attention(self, layer: RingLayer, query: torch.Tensor, scale: float | None,
                              softcap: float | None) -> torch.Tensor:
        """query ``[B, Hq, D]`` over the slots of a sliding-window layer's ring that its window and the row's
        padding leave (:func:`retrofit.static_cache.ring_selection`) -> ``[B, Hq, D]``; device ops only."""
        offsets = self.ring_offsets.get(layer.size)
        if offsets is None:
            offsets = self.ring_offsets[layer.size] = torch.arange(layer.size, device=query.device)
        indices, counts = ring_selection(layer, self.row_start, offsets, layer.keys.shape[1])
        zeros = torch.zeros_like(self.row_start)
        return sparse_decode_attention(query, layer.keys, layer.values, indices, counts, zeros,
                                       zeros + layer.size, block_size=1, scale=scale, softcap=softcap)

    def _sdpa_decode(self, layer, query: torch.Tensor, written: torch.Tensor, scale: float | None) -> torch.Tensor:
        """query ``[B, Hq, 1, D]`` over the layer's valid positions ``[row_start, written)`` -> ``[B, 1, Hq, D]``."""
        if self.positions_of_buffer is None:
            self.positions_of_buffer = torch.arange(layer.keys.shape[2], device=query.device)
        valid = (self.positions_of_buffer >= self.row_start[:, None]) & (self.positions_of_buffer < written)
        out = torch.nn.functional.scaled_dot_product_attention(query, layer.keys, layer.values,
                                                               attn_mask=valid[:, None, None, :], scale=scale,
                                                               enable_gqa=True)
        return out.transpose(1, 2)

    def mask(self, batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
             attention_mask: torch.Tensor | None = None, **kwargs):
        """transformers' mask interface: none for a decode token (the attention reads each row's valid range);
        for a prefill chunk the model's own mask over the positions written so far, so that its last columns are
        the chunk itself (what linear-attention layers read their padding from)."""
        if q_length == 1:
            return None
        if attention_mask is not None:
            attention_mask = attention_mask[:, : self.chunk_end]
        return self.base_mask(batch_size=batch_size, q_length=q_length, kv_length=self.chunk_end,
                              q_offset=self.chunk_start, kv_offset=0, attention_mask=attention_mask, **kwargs)

    def installed(self) -> ExitStack:
        """A context in which the model runs the engine's attention and masks, and, where the kernels run on Triton,
        the fused decode forward of its supported decoder layers (:mod:`retrofit.generation.fused_layers`); all undone
        on exit."""
        stack = ExitStack()
        stack.enter_context(attention_function(self.model, self.attention, "engine", mask_function=self.mask))
        if self.fuse_layers and backend_for(self.device) == "triton":
            self.fusion = stack.enter_context(
                DecodeFusion(self.model, self.cache, self.static_decode_attention, self.session).installed())
            stack.callback(setattr, self, "fusion", None)
        return stack

    # -- prefill and decode ----------------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None):
        output = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                            use_cache=True, logits_to_keep=1, **{self.cache_argument: self.cache})
        return output.logits[:, -1]

    def prefill(self) -> None:
        """Run the prompt through the model in chunks of ``prefill_chunk`` tokens and choose the first new token.

        Activation memory is bounded by one chunk: per layer the MLP's ``[B, chunk, intermediate]`` and the mask
        ``[B, chunk, written]`` (booleans; none without padding in the first chunk), whatever the prompt length."""
        mask = self.attention_mask
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        logits = None
        for start in range(0, self.prompt_length, self.prefill_chunk):
            end = min(start + self.prefill_chunk, self.prompt_length)
            self.chunk_start, self.chunk_end = start, end
            with prompt_continues(self.model) if end < self.prompt_length else nullcontext():
                logits = self._forward(self.input_ids[:, start:end], positions[:, start:end], mask[:, :end])
        self._commit(logits)
        if self.session is not None:  # e.g. ClusterKV clusters the prompt here, before the first decode step
            self.session.maintain(self.cache, written=self.prompt_length)

    def _commit(self, logits: torch.Tensor) -> None:
        """Choose the next token of every row from ``logits [B, V]`` and record it (device ops only)."""
        chosen = torch.where(self.finished, self.pad, self.chooser(logits))
        self.out.index_copy_(1, self.step_index, chosen[:, None])
        ending = torch.isin(chosen, self.eos) & ~self.finished
        self.finished_at.copy_(torch.where(ending, self.step_index, self.finished_at))
        self.finished.logical_or_(ending)
        self.tokens.copy_(chosen)
        self.step_index.add_(1)

    def step(self) -> None:
        """One decode step: feed each row's last token at its position, choose the next (device ops only)."""
        with self.fusion.decoding() if self.fusion is not None else nullcontext():
            logits = self._forward(self.tokens[:, None], self.positions, None)
        self.positions.add_(1)
        self._commit(logits)

    def after_step(self) -> None:
        """Host-side upkeep between steps, outside a captured step (ClusterKV's scheduled re-clustering)."""
        self.steps_done += 1
        if self.session is not None:
            self.session.maintain(self.cache, written=self.prompt_length + self.steps_done)

    def produced(self) -> int:
        """How many new tokens the output holds: up to the last row's end token, or all of them (one host read)."""
        last_end = int(self.finished_at.max())
        return min(last_end + 1, self.steps_done + 1)

    def cache_state(self) -> dict[str, Any]:
        """Everything the decode state holds on the device (for the allocation checks and the byte counts)."""
        return {"cache": self.cache, "tokens": self.tokens, "positions": self.positions, "out": self.out,
                "step_index": self.step_index, "finished": self.finished, "finished_at": self.finished_at}
