"""``sparse_prefill(model, method=..., threshold=...)``: the context manager that runs the model's softmax layers'
prefill block-sparse.

Inside the context (and only there), every multi-token attention call of an eligible layer (a softmax layer whose
cache grows with the context and whose logits are not softcapped, as the architecture record says; a hybrid's
remaining softmax layers) over at least ``min_length`` keys asks the method which key blocks each query block of
each head computes, and runs ``retrofit.kernels.sparse_prefill_attention`` on them. Everything else (decode tokens,
sliding-window and softcapped layers, shorter calls, masks of another layout) runs the model's own implementation.

Where it hooks in: it runs the model's attention through its own function (``attention_functions``: a private name in
transformers' registries, masks built exactly as before), which ``model.generate`` and plain forward calls reach.
``retrofit.generate``'s engine and a ``sparse_decoding`` session run attention through functions of their own; they
send the calls they would run densely through :func:`prefill_or_dense`, which finds the open ``sparse_prefill``. A
session opened first (or ``sparse_decoding(..., prefill=...)``) keeps its function in place (:func:`routed_prefill`),
so that its methods still see every prefill chunk. On exit everything is undone.
"""
from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from retrofit.attention_functions import attention_function, dense_attention, implementation_of
from retrofit.errors import RetrofitError
from retrofit.kernels import use_backend
from retrofit.kernels.sparse_prefill import sparse_prefill_attention
from retrofit.model_info import attention_layout, restrict_layers
from retrofit.sparse.params import KERNELS
from retrofit.sparse.prefill.blocks import BlockGrid, block_lists, left_padding
from retrofit.sparse.prefill.methods import PrefillMethod, build_prefill_method

_ACTIVE: "weakref.WeakKeyDictionary[torch.nn.Module, SparsePrefill]" = weakref.WeakKeyDictionary()
_ROUTED: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()


def active_prefill(model: torch.nn.Module) -> "SparsePrefill | None":
    """The ``sparse_prefill`` open on ``model`` now, if any."""
    return _ACTIVE.get(model)


def own_implementation(model: torch.nn.Module) -> str:
    """The attention implementation ``model`` runs now, looking through an open ``sparse_prefill``'s function (what
    a session or the generation engine falls back to; they route prefill calls with :func:`prefill_or_dense`)."""
    prefill = _ACTIVE.get(model)
    name = implementation_of(model)
    return prefill.fallback if prefill is not None and name == prefill.installed_as else name


def prefill_or_dense(model: torch.nn.Module, implementation: str, module, query, key, value, attention_mask,
                     **kwargs):
    """One attention call of ``model`` that a session or the generation engine would run densely with
    ``implementation``: through the ``sparse_prefill`` open on the model, if any (which runs ``implementation``
    where it does not apply), else densely. Shapes: transformers' attention interface."""
    prefill = _ACTIVE.get(model)
    if prefill is None:
        return dense_attention(implementation, module, query, key, value, attention_mask, **kwargs)
    return prefill.run(implementation, module, query, key, value, attention_mask, **kwargs)


@contextmanager
def prompt_continues(model: torch.nn.Module) -> Iterator[None]:
    """While open, the calls of ``model`` are a chunk of a prompt that more chunks follow (retrofit's engine opens
    it around every chunk but the last): the open ``sparse_prefill``, if any, runs them without its method's
    ``last_query_blocks``, which only the prompt's last position needs (the first new token is read there). Without
    an open ``sparse_prefill`` it does nothing."""
    prefill = _ACTIVE.get(model)
    if prefill is None:
        yield
        return
    prefill.more_chunks = True
    try:
        yield
    finally:
        prefill.more_chunks = False


@contextmanager
def routed_prefill(model: torch.nn.Module) -> Iterator[None]:
    """While open, a ``sparse_prefill`` opened on ``model`` installs no attention function of its own: the caller (a
    sparse decoding session) routes every multi-token attention call of the model through
    :meth:`SparsePrefill.run` itself."""
    _ROUTED[model] = _ROUTED.get(model, 0) + 1
    try:
        yield
    finally:
        _ROUTED[model] -= 1
        if not _ROUTED[model]:
            del _ROUTED[model]


@dataclass(frozen=True)
class PrefillCall:
    """One prefill call of one layer: ``queries`` over ``keys``; ``computed`` of the ``causal`` (head, query block,
    key block) triples of its rows (the blocks dense attention computes); ``sparse`` False for a call that ran dense
    (fewer keys than ``min_length``: then computed = causal)."""

    layer: int
    queries: int
    keys: int
    computed: int
    causal: int
    sparse: bool

    @property
    def fraction(self) -> float:
        return self.computed / self.causal if self.causal else 1.0


def blocks_computed(calls: Iterable[PrefillCall]) -> dict[int, float]:
    """layer -> the share of the causal blocks its calls computed (all its calls together)."""
    computed: dict[int, list[int]] = {}
    for call in calls:
        totals = computed.setdefault(call.layer, [0, 0])
        totals[0] += call.computed
        totals[1] += call.causal
    return {layer: done / causal if causal else 1.0 for layer, (done, causal) in sorted(computed.items())}


def share_computed(calls: Iterable[PrefillCall]) -> float | None:
    """The share of the causal blocks that ``calls`` computed, every layer and call pooled (None: no call)."""
    calls = list(calls)
    causal = sum(call.causal for call in calls)
    return sum(call.computed for call in calls) / causal if causal else None


class SparsePrefill:
    """What ``sparse_prefill`` yields: the method, the layers it applies to, and a record of every prefill call
    (:attr:`calls`, :meth:`take_calls`, :func:`blocks_computed`)."""

    def __init__(self, model: torch.nn.Module, method: PrefillMethod, layers: list[int], kernel: str):
        self.model = model
        self.method = method
        self.layers = frozenset(layers)
        self.kernel = kernel
        self.backend = KERNELS[kernel]
        self.fallback = implementation_of(model)  # what the eligible layers' other calls and other layers run
        self.installed_as: str | None = None  # the private name of its attention function, when it installed one
        self.calls: list[PrefillCall] = []
        self.more_chunks = False  # the calls now are a prompt chunk that more follow (:func:`prompt_continues`)

    def take_calls(self) -> list[PrefillCall]:
        """The calls recorded since the last take (and forget them)."""
        calls, self.calls = self.calls, []
        return calls

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """transformers' attention interface: query [B, Hq, T, D], key/value [B, Hkv, N, D] -> ([B, T, Hq, D],
        None); what ``sparse_prefill`` installs when no decoding session routes the calls."""
        return self.run(self.fallback, module, query, key, value, attention_mask, **kwargs)

    def run(self, fallback: str, module, query, key, value, attention_mask, **kwargs):
        """The attention of one call, the sparse prefill where it applies and ``fallback`` (an attention
        implementation's name) otherwise; shapes as :meth:`attention`."""
        if not self._applies(module, query, kwargs):
            return dense_attention(fallback, module, query, key, value, attention_mask, **kwargs)
        B, Hq, T, D = query.shape
        N = key.shape[2]
        kv_start = left_padding(attention_mask, B, N, query.device)
        if kv_start is None:  # not causal attention over left-padded rows ending at the chunk: not ours to cut
            return dense_attention(fallback, module, query, key, value, attention_mask, **kwargs)
        method = self.method
        grid = BlockGrid(T, N, N - T, method.block_size, kv_start, ends_prompt=not self.more_chunks)
        causal = int(grid.causal().sum()) * Hq
        if N < method.min_length:
            self.calls.append(PrefillCall(module.layer_idx, T, N, causal, causal, sparse=False))
            return dense_attention(fallback, module, query, key, value, attention_mask, **kwargs)
        scale = kwargs.get("scaling")
        scale = D**-0.5 if scale is None else scale
        with use_backend(self.backend) if self.backend != "auto" else nullcontext():
            indices, counts = block_lists(method.choose(query, key, grid, scale))
            out = sparse_prefill_attention(query, key, value, indices, counts, kv_start, method.block_size,
                                           q_offset=grid.q_offset, scale=scale)
        self.calls.append(PrefillCall(module.layer_idx, T, N, int(counts.sum()), causal, sparse=True))
        return out, None

    def _applies(self, module, query, kwargs) -> bool:
        """A multi-token call of an eligible layer, without dropout, a window or a cap, outside autograd."""
        return (query.shape[2] > 1 and getattr(module, "layer_idx", None) in self.layers
                and not kwargs.get("dropout") and not kwargs.get("sliding_window") and not kwargs.get("softcap")
                and not (torch.is_grad_enabled() and query.requires_grad))


def prefill_layers(model: torch.nn.Module, layers: Iterable[int] | str | None = None) -> list[int]:
    """The layers sparse prefill applies to: the softmax layers whose cache grows with the context and whose logits
    are not softcapped (architecture record), optionally restricted to ``layers`` (indices, or "0,1,2" from the
    CLI); a RetrofitError (one line) for none or for a layer that is not one of them."""
    layout = attention_layout(model)
    layout.require_interface("sparse prefill")
    eligible = [i for i in layout.unbounded_layers if layout.layers[i].softcap is None]
    if not eligible:
        raise RetrofitError(f"{type(model).__name__} has no softmax-attention layer without a sliding window or logit "
                            "softcapping for sparse prefill to apply to")
    if layers is None:
        return eligible
    return restrict_layers(layers, eligible, f"layers of {type(model).__name__} that sparse prefill applies to "
                           "(softmax attention without a sliding window or softcapping)")


@contextmanager
def sparse_prefill(model: torch.nn.Module, method: str = "xattention", kernel: str = "auto",
                   layers: Iterable[int] | str | None = None, **params: Any) -> Iterator[SparsePrefill]:
    """Run the prefill of ``model``'s softmax layers block-sparse inside a ``with`` block.

    >>> with sparse_prefill(model, method="xattention", threshold=0.9) as prefill:
    ...     ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)
    ...     print(blocks_computed(prefill.calls))      # layer -> share of the causal blocks computed

    ``method``: a registered name (``PREFILL_METHODS.names()``); ``params``: its fields (``threshold``,
    ``block_size``, ``min_length``, ...; strings from the CLI are converted); ``kernel``: "auto" (Triton on CUDA,
    the PyTorch reference elsewhere), "triton" or "reference"; ``layers``: restrict it to these layer indices. Works
    inside ``sparse_decoding`` too (or pass ``prefill=`` to it). The model is restored exactly on exit.
    """
    if kernel not in KERNELS:
        raise RetrofitError(f"kernel={kernel!r} is invalid: choose from {', '.join(KERNELS)}")
    if model in _ACTIVE:
        raise RetrofitError("sparse_prefill is already open on this model: close it before opening another")
    prefill = SparsePrefill(model, build_prefill_method(method, **params), prefill_layers(model, layers), kernel)
    with ExitStack() as undo:
        _ACTIVE[model] = prefill
        undo.callback(_ACTIVE.pop, model, None)
        if model not in _ROUTED:
            prefill.installed_as = undo.enter_context(attention_function(model, prefill.attention, "prefill"))
        yield prefill
