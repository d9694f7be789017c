"""The decode step's decoder layers with fewer kernels: the fused forward of a Llama-family layer for one token.

transformers' own forward of a Llama decoder layer launches 40 kernels per decode token in float32 under the engine
(seven GEMMs, the two attention kernels, each RMSNorm six, more in bf16, the rotation of q and k ten, the static
cache's index arithmetic and copies five, the MLP's SiLU and product two, the residual adds two; counted by
``benchmarks/decode_overhead.py``). Inside a CUDA graph each costs a few microseconds whatever its size, which at
batch 1 is most of a decode step. While :class:`DecodeFusion` is installed, a decode step of a supported layer runs

    rms_norm -> q, k, v projections as one GEMM -> rotary_qk_into_cache (rotate q and k, write k and v into the
    static cache) -> the engine's decode attention -> o projection -> add_rms_norm (residual add and norm, one
    kernel) -> gate, up projections -> silu_mul -> down projection added onto the residual in place (one GEMM, beta 1)

with the kernels of :mod:`retrofit.kernels`: 11 kernels (5 GEMMs, 2 for the attention, 4 fused ones). The math is the
model's: float32 norm statistics rounded as ``LlamaRMSNorm`` rounds, the rotation's products rounded as
``apply_rotary_pos_emb`` rounds. The one difference is that the down projection's GEMM adds the residual before
rounding once (the model rounds the product, then the sum). The projections read the modules' weights through
transposed views, nothing copied; q, k and v read theirs as one ``[out_q + out_k + out_v, hidden]`` matrix: the
first time a layer is fused, its three weights (and biases) move into one buffer, row block after row block, and
the modules' Parameters become views of it (the same Parameter objects and values, no memory added; reading them as
one GEMM takes 20.9 us instead of 30.9 at Llama-3-8B's shapes on an H100: benchmarks/history/figures-2026-12-06.md,
Kernel time per decode token). ``save_pretrained`` writes such views as separate tensors.

Supported: the decoder layers of the families whose architecture record says their forward is the one above
(``Architecture.decode_fusion``: Llama, Mistral, Qwen2) whose norms are the model's RMSNorm and whose MLP is SiLU-gated
with plain ``nn.Linear`` projections; the attention part only where the layer's record has no window shorter than the
cache, no logit softcap and rotary over the whole head. Every other layer runs unfused (``retrofit bench`` says which). The rotation and the cache write are fused
where the attention module is the model's own with plain projections and the layer's cache is a plain
``transformers.cache_utils.StaticLayer`` (the engine's dense cache; the engine's decode attention follows) or a
``retrofit.sparse_decoding`` session's ``SparseLayer`` whose method stores decode tokens the default way (the
session's attention follows: its method's selection, then the sparse kernel; every method but StreamingLLM, which
writes its ring itself). Elsewhere (StreamingLLM's layers, the linear-attention layers of a converted hybrid,
sliding-window layers) the layer's own attention module runs and only the norms and the MLP are fused, except that
a model's own attention module (StreamingLLM's) gets its q, k and v from the one GEMM
(:meth:`MergedProjection.served`): 5 GEMMs a layer instead of 7. Prefill chunks and anything outside
:meth:`DecodeFusion.decoding` run the layers' own forward unchanged.

A fused layer writes the token's key and value at position ``cumulative_length - 1`` of its ``StaticLayer``
(``write_pos - 1`` of a ``SparseLayer``, whose ``kv_end`` advances too): the step advances the counters of all those
layers first, in one ``_foreach_add_`` per dtype (what ``StaticLayer.update`` does with one ``add_`` per layer,
``SparseLayer.write_next`` with two), so the layers' bookkeeping is what their own update leaves.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers.cache_utils import StaticLayer

from retrofit import architecture
from retrofit.architecture import Architecture, LayerAttention
from retrofit.kernels import add_rms_norm, rms_norm, rotary_qk_into_cache, silu_mul
from retrofit.sparse.cache import SparseLayer
from retrofit.sparse.patch import SparseSession

# (layer's StaticLayer, rotated queries [B, Hq, D], scale) -> attention output [B, Hq, D]
DecodeAttention = Callable[[StaticLayer, torch.Tensor, float], torch.Tensor]


@contextlib.contextmanager
def forwards_replaced(replacements: list[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """Inside the block each module's ``forward`` is its replacement (an instance attribute, so ``module(...)`` calls
    it, hooks included); on exit whatever the module held there before is put back."""
    saved = [(module, module.__dict__.get("forward")) for module, _ in replacements]
    try:
        for module, forward in replacements:
            module.forward = forward
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


def _from_transformers(module: torch.nn.Module) -> bool:
    """A module of a transformers modeling file (not a wrapper or a replacement put there)."""
    return module is not None and type(module).__module__.startswith("transformers.models.")


def _is_silu(activation) -> bool:
    """``nn.SiLU`` or transformers' ``SiLUActivation`` (what ``ACT2FN["silu"]`` gives), both ``F.silu``."""
    return isinstance(activation, torch.nn.SiLU) or (type(activation).__name__ == "SiLUActivation"
                                                     and type(activation).__module__ == "transformers.activations")


@dataclass(frozen=True)
class Projection:
    """An ``nn.Linear`` applied to ``x [B, in]`` as one GEMM on a transposed view of its weight (no copy)."""

    weight_t: torch.Tensor  # [in, out]
    bias: torch.Tensor | None

    @classmethod
    def of(cls, module) -> "Projection | None":
        if type(module) is not torch.nn.Linear:  # e.g. a LoRA wrapper: not a plain GEMM
            return None
        return cls(module.weight.t(), module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, in] -> [B, out]."""
        return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual [B, out] += x [B, in] @ W^T (+ bias)``, in place: one GEMM with beta = 1."""
        residual.addmm_(x, self.weight_t)
        return residual if self.bias is None else residual.add_(self.bias)


def rows_of_one_buffer(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """``parameters`` (same dtype, device and trailing shape) as consecutive row blocks of one tensor
    ``[sum of rows, *trailing]``. Where they are not that already, they are moved there: one buffer is allocated, each
    block copied in, and each Parameter's data becomes its view (so the old storages are freed: no memory added once
    done, the buffer's size on the way)."""
    first = parameters[0]
    rows = sum(parameter.shape[0] for parameter in parameters)
    shape = (rows, *first.shape[1:])
    offsets = [first.storage_offset()]
    for parameter in parameters[:-1]:
        offsets.append(offsets[-1] + parameter.numel())
    already = all(parameter.is_contiguous() and parameter.untyped_storage().data_ptr()
                  == first.untyped_storage().data_ptr() and parameter.storage_offset() == offset
                  for parameter, offset in zip(parameters, offsets))
    if already:
        # a contiguous tensor's strides depend only on its trailing dimensions: the first block's serve the whole
        return first.detach().as_strided(shape, first.stride(), first.storage_offset())
    return _moved_into(torch.empty(shape, dtype=first.dtype, device=first.device), parameters,
                       [parameter.shape[0] for parameter in parameters])


def _moved_into(buffer: torch.Tensor, parameters: list[torch.nn.Parameter | None], rows: list[int]) -> torch.Tensor:
    """Copy each parameter into its block of ``rows`` consecutive rows of ``buffer`` and make its data that view (a
    None entry keeps its block as the buffer holds it); returns ``buffer``."""
    row = 0
    with torch.no_grad():
        for parameter, count in zip(parameters, rows):
            if parameter is not None:
                block = buffer[row: row + count]
                block.copy_(parameter)
                parameter.data = block
            row += count
    return buffer


# merged biases with zero blocks, by the first module with a bias: a later merge of the same modules finds its
# buffer here (where rows_of_one_buffer finds its from the parameters' storage), so a decode graph captured over it
# stays valid when the engine installs its fused layers again
_ZERO_FILLED_BIASES: "weakref.WeakKeyDictionary[torch.nn.Module, torch.Tensor]" = weakref.WeakKeyDictionary()


def _bias_with_zeros(modules: list[torch.nn.Linear], sizes: tuple[int, ...]) -> torch.Tensor:
    """One bias ``[sum of sizes]`` for merged ``modules`` of which some have a bias: zeros where one has none, the
    others moved in (each Parameter's data becomes its view), once: the same buffer for the same modules later."""
    biases = [module.bias for module in modules]
    key = next(module for module in modules if module.bias is not None)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    buffer = _ZERO_FILLED_BIASES.get(key)
    if buffer is not None and all(bias is None or bias.data_ptr() == buffer[offset:].data_ptr()
                                  for bias, offset in zip(biases, offsets)):
        return buffer
    buffer = _moved_into(torch.zeros(sum(sizes), dtype=key.bias.dtype, device=key.bias.device), biases, list(sizes))
    _ZERO_FILLED_BIASES[key] = buffer
    return buffer


@dataclass(frozen=True)
class MergedProjection:
    """Several ``nn.Linear`` on the same input as one GEMM over their weights' rows in one buffer
    (:func:`rows_of_one_buffer`); ``x [B, in]`` -> one ``[B, out_i]`` column view per module."""

    weight_t: torch.Tensor  # [in, sum of out]
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, modules) -> "MergedProjection | None":
        if any(type(module) is not torch.nn.Linear for module in modules):
            return None
        weights, biases = [module.weight for module in modules], [module.bias for module in modules]
        if len({(weight.dtype, weight.device, weight.shape[1]) for weight in weights}) != 1:
            return None
        sizes = tuple(weight.shape[0] for weight in weights)
        if all(bias is None for bias in biases):
            bias = None
        elif all(bias is not None for bias in biases):
            bias = rows_of_one_buffer(biases)
        else:
            bias = _bias_with_zeros(modules, sizes)
        return cls(rows_of_one_buffer(weights).t(), bias, sizes)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, in] -> ([B, out_0], [B, out_1], ...), views of one [B, sum of out] product."""
        out = torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        return out.split(self.sizes, dim=1)

    @contextlib.contextmanager
    def served(self, modules, hidden: torch.Tensor) -> Iterator[None]:
        """Inside the block, ``modules[i](hidden)`` returns the i-th column block of one product over ``hidden [B, T,
        in]`` (computed here, one GEMM) instead of running its own GEMM; called on any other input, a module runs as
        usual. So an attention module that projects its input three times runs as written on one GEMM."""
        B, T, width = hidden.shape
        outputs = [out.view(B, T, -1) for out in self(hidden.view(B * T, width))]

        def serving(own, output):
            def forward(x):
                return output if x is hidden else own(x)
            return forward

        with forwards_replaced([(module, serving(module.forward, output)) for module, output in zip(modules, outputs)]):
            yield


@dataclass(frozen=True)
class Norm:
    """An RMSNorm module's weight and epsilon."""

    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module) -> "Norm | None":
        """The norm of a Llama-style RMSNorm module (``weight * normed``, ``variance_epsilon``), else None."""
        if not (_from_transformers(module) and type(module).__name__.endswith("RMSNorm")
                and hasattr(module, "variance_epsilon") and isinstance(getattr(module, "weight", None), torch.Tensor)):
            return None
        return cls(module.weight, float(module.variance_epsilon))


@dataclass(frozen=True)
class FusedAttention:
    """The attention module's projections and shapes, for the fused rotation, cache write and attention."""

    qkv: MergedProjection
    o: Projection
    heads: int
    kv_heads: int
    head_dim: int
    scale: float

    @classmethod
    def of(cls, module, facts: LayerAttention, head_dim: int) -> "FusedAttention | None":
        """The fused attention of ``module`` (a softmax layer whose record is ``facts``), or None where the layer is
        not one the fused rotation and attention compute: a logit softcap or a partial rotation. (A sliding window
        shorter than the cache puts the layer in a ring, which :meth:`FusedDecoderLayer.route` leaves to the layer's
        own attention; a longer one never acts.)"""
        if not _from_transformers(module) or not facts.softmax:
            return None
        if facts.softcap is not None or facts.rotary_dims != head_dim:
            return None
        o = Projection.of(getattr(module, "o_proj", None))
        if o is None:
            return None
        qkv = MergedProjection.of([getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")])
        if qkv is None:
            return None
        head_dim = module.head_dim
        return cls(qkv, o, qkv.sizes[0] // head_dim, qkv.sizes[1] // head_dim, head_dim, float(module.scaling))


class FusedDecoderLayer:
    """One decoder layer's fused decode-token forward (see the module docstring); ``forward`` stands in for the
    layer's own while installed and runs the layer's own for anything but a decode token of the fusion's step."""

    def __init__(self, layer: torch.nn.Module, fusion: "DecodeFusion", input_norm: Norm, post_norm: Norm,
                 gate: Projection, up: Projection, down: Projection, attention: FusedAttention | None,
                 attention_module: torch.nn.Module):
        self.layer, self.fusion = layer, fusion
        self.attention_module = attention_module
        self.index = attention_module.layer_idx
        self.input_norm, self.post_norm = input_norm, post_norm
        self.gate, self.up, self.down = gate, up, down
        self.attention = attention
        self.original = layer.forward
        self.step_route: str | None = None  # this step's route(), set by DecodeFusion.decoding
        # an attention module of another kind that names the projections of its input (a converted layer: q, k, v
        # and its gates' first projections) runs them as one GEMM
        self.input_modules = tuple(attention_module.input_projections()) if (
            attention is None and hasattr(attention_module, "input_projections")) else ()
        self.inputs = MergedProjection.of(self.input_modules) if self.input_modules else None

    @classmethod
    def of(cls, layer: torch.nn.Module, fusion: "DecodeFusion", arch: Architecture, facts: LayerAttention,
           head_dim: int) -> "FusedDecoderLayer | None":
        """The fused forward of ``layer`` (its family's record ``arch``, the layer's ``facts``), or None where its
        structure is not the supported one."""
        if not (arch.decode_fusion and _from_transformers(layer)):
            return None
        attn, mlp = getattr(layer, arch.attention, None), getattr(layer, arch.mlp, None)
        if attn is None or mlp is None or not isinstance(getattr(attn, "layer_idx", None), int):
            return None
        norms = Norm.of(getattr(layer, "input_layernorm", None)), Norm.of(getattr(layer, "post_attention_layernorm",
                                                                                   None))
        projections = [Projection.of(getattr(mlp, name, None)) for name in ("gate_proj", "up_proj", "down_proj")]
        if None in norms or None in projections or not _is_silu(getattr(mlp, "act_fn", None)):
            return None
        return cls(layer, fusion, *norms, *projections, FusedAttention.of(attn, facts, head_dim), attn)

    def route(self) -> str | None:
        """Where this step's token goes: ``"static"`` (rotated, written and attended here over a ``StaticLayer``: the
        engine's decode attention), ``"sparse"`` (rotated and written here into a sparse session's layer, then
        attended through the session: its method's selection), or None (the layer's own attention module runs).
        :meth:`DecodeFusion.decoding` asks once per step and keeps the answer in ``step_route``."""
        layer = self.fusion.cache.layers[self.index]
        if self.attention is None:
            return None
        if type(layer) is StaticLayer and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            return "static"
        if self.fusion.session is not None and isinstance(layer, SparseLayer) and layer.fusable_decode_write():
            return "sparse"
        return None

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """hidden_states [B, 1, H] (a decode token) -> [B, 1, H]; anything else goes to the layer's own forward."""
        if args or not self.fusion.active or hidden_states.shape[1] != 1:
            return self.original(hidden_states, *args, **kwargs)
        B, _, H = hidden_states.shape
        residual = hidden_states.reshape(B, H)
        normed = rms_norm(residual, self.input_norm.weight, self.input_norm.eps)
        if self.step_route is not None:
            attended = self._attention(normed, kwargs)
        else:
            attended = self._own_attention(normed.view(B, 1, H), kwargs).reshape(B, H)
        normed, residual = add_rms_norm(attended, residual, self.post_norm.weight, self.post_norm.eps)
        activated = silu_mul(self.gate(normed), self.up(normed))
        return self.down.add_into(residual, activated).view(B, 1, H)

    def _own_attention(self, normed: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """normed [B, 1, H] -> the layer's own attention module's output [B, 1, H]: StreamingLLM's attention (its
        q, k and v served from one GEMM), a converted layer's recurrence (its input projections served from one)."""
        attn = self.attention_module
        if self.attention is None:
            if self.inputs is None:
                return attn(hidden_states=normed, **kwargs)[0]
            with self.inputs.served(self.input_modules, normed):
                return attn(hidden_states=normed, **kwargs)[0]
        with self.attention.qkv.served([attn.q_proj, attn.k_proj, attn.v_proj], normed):
            return attn(hidden_states=normed, **kwargs)[0]

    def _attention(self, normed: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """normed [B, H] -> the attention block's output [B, H] (before the residual add): the token rotated and
        written in one kernel, then the engine's decode attention over a ``StaticLayer`` or the session's over a
        ``SparseLayer``."""
        attention, layer = self.attention, self.fusion.cache.layers[self.index]
        if kwargs.get("position_embeddings") is None:
            raise RuntimeError(f"decoder layer {self.index} was called without position_embeddings: the fused decode "
                               "step needs the model's (cos, sin)")
        cos, sin = kwargs["position_embeddings"]
        B, D = normed.shape[0], attention.head_dim
        q, k, v = attention.qkv(normed)
        q, k, v = q.view(B, attention.heads, D), k.view(B, attention.kv_heads, D), v.view(B, attention.kv_heads, D)
        if self.step_route == "sparse":
            attended = self.fusion.session.decode(layer, layer.write_rotated_next(q, k, v, cos, sin), attention.scale)
        else:
            queries = rotary_qk_into_cache(q, k, v, cos, sin, layer.keys, layer.values, layer.cumulative_length)
            attended = self.fusion.attend(layer, queries, attention.scale)
        return attention.o(attended.view(B, attention.heads * D))


def fusion_coverage(model: torch.nn.Module) -> dict[str, object]:
    """Which decoder layers of ``model`` a decode step on the Triton backend runs fused, read off the architecture
    record and the modules without changing anything (no weights merged): ``{"layers": [fused decoder layers],
    "attention": [of those, the ones whose rotation, cache write and attention are fused too], "total": L,
    "sliding": [of those, the sliding-window ones], "family": model_type, "record": whether the family has a fused
    decode path}``. A sliding-window layer whose window is shorter than the cache keeps its own attention over a ring
    even where listed under "attention"."""
    arch = architecture.of(model)
    config = architecture.text_config(model)
    head_dim = arch.head_dim(config)
    layers, attention, sliding = [], [], []
    for index, (block, facts) in enumerate(zip(arch.blocks(model), arch.layers(config))):
        if not (arch.decode_fusion and _from_transformers(block)):
            continue
        attn, mlp = getattr(block, arch.attention, None), getattr(block, arch.mlp, None)
        norms = [getattr(block, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
        plain = [type(getattr(mlp, name, None)) is torch.nn.Linear for name in ("gate_proj", "up_proj", "down_proj")]
        if attn is None or not all(plain) or not _is_silu(getattr(mlp, "act_fn", None)) or \
                any(_norm_fields(norm) is None for norm in norms):
            continue
        layers.append(index)
        if facts.window is not None:
            sliding.append(index)
        projections = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if _from_transformers(attn) and facts.softmax and facts.softcap is None and facts.rotary_dims == head_dim \
                and all(type(module) is torch.nn.Linear for module in projections):
            attention.append(index)
    return {"layers": layers, "attention": attention, "sliding": sliding, "total": len(arch.blocks(model)),
            "family": arch.model_type, "record": arch.decode_fusion}


def _norm_fields(module) -> tuple[torch.Tensor, float] | None:
    norm = Norm.of(module)
    return None if norm is None else (norm.weight, norm.eps)


class FusedNorm:
    """The model's final RMSNorm as one kernel for a decode token (the layer's own forward otherwise)."""

    def __init__(self, module: torch.nn.Module, norm: Norm, fusion: "DecodeFusion"):
        self.module, self.norm, self.fusion = module, norm, fusion
        self.original = module.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.fusion.active or hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
            return self.original(hidden_states)
        return rms_norm(hidden_states, self.norm.weight, self.norm.eps)


class DecodeFusion:
    """The fused decode forward of a model's supported decoder layers (and its final norm), for one engine.

    ``cache``: the engine's cache; ``attend(layer, queries [B, Hq, D], scale) -> [B, Hq, D]``: the engine's decode
    attention over a ``StaticLayer`` (its valid positions ``[row_start, cumulative_length)``); ``session``: the
    ``retrofit.sparse_decoding`` session whose layers the cache holds, if any. :meth:`installed` puts the fused
    forwards in place (undone on exit); they act only inside :meth:`decoding`, one decode step.
    """

    def __init__(self, model: torch.nn.Module, cache, attend: DecodeAttention, session: SparseSession | None = None):
        self.model, self.cache, self.attend, self.session = model, cache, attend, session
        self.active = False
        self.layers: list[FusedDecoderLayer] = []
        self.final_norm: FusedNorm | None = None
        arch = architecture.of(model)
        config = architecture.text_config(model)
        head_dim = arch.head_dim(config)
        for layer, facts in zip(arch.blocks(model), arch.layers(config)):
            fused = FusedDecoderLayer.of(layer, self, arch, facts, head_dim)
            if fused is not None:
                self.layers.append(fused)
        final = arch.final_norm_of(model)
        norm = Norm.of(final)
        if norm is not None and self.layers:
            self.final_norm = FusedNorm(final, norm, self)

    def fused_layer_indices(self) -> list[int]:
        """The layers whose decode step runs fused (the audit of what :meth:`installed` replaces)."""
        return [layer.index for layer in self.layers]

    @contextlib.contextmanager
    def installed(self) -> Iterator["DecodeFusion"]:
        """The fused forwards stand in for the modules' own inside the block (instance attributes, removed on exit,
        whatever the module held there before put back)."""
        replaced = [(fused.layer, fused.forward) for fused in self.layers]
        if self.final_norm is not None:
            replaced.append((self.final_norm.module, self.final_norm.forward))
        with forwards_replaced(replaced):
            try:
                yield self
            finally:
                # each fused forward holds this fusion and this fusion them: a reference cycle through the cache and
                # the engine (``attend``) that only Python's cycle collector would free. Broken here, the cache goes
                # when the engine lets go of it (a long evaluation held one cache per generate call, 73 GB at batch 32)
                self.layers, self.final_norm = [], None

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """One decode step of the engine: advances the counters the fused layers write at (the static layers'
        lengths, the sparse layers' write positions and valid ends: one ``_foreach_add_`` per dtype), and makes the
        fused forwards act inside the block."""
        counters: dict[torch.dtype, list[torch.Tensor]] = {}
        for fused in self.layers:
            fused.step_route = fused.route()
            layer = self.cache.layers[fused.index]
            if fused.step_route == "static":
                advanced = [layer.cumulative_length]
            elif fused.step_route == "sparse":
                advanced = list(layer.decode_counters())
            else:
                continue
            for counter in advanced:
                counters.setdefault(counter.dtype, []).append(counter)
        for group in counters.values():
            torch._foreach_add_(group, 1)
        self.active = True
        try:
            yield
        finally:
            self.active = False
