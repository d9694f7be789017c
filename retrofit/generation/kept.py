"""The last generation's static state, kept per model for the next call of the same shape.

Allocating the static cache and capturing the decode step as a CUDA graph cost about as much as decoding a few
dozen tokens, and evaluation calls ``generate`` once per item. So after a call the engine keeps, per model, its
:class:`~retrofit.generation.engine.StaticGeneration` (the cache and the step's device tensors) and the captured
graph; the next call with the same batch size, cache-length bucket and options loads its prompt into the same
tensors (:meth:`StaticGeneration.load`) and replays the same graph. One state is kept per model (a call of another
shape frees it first), nothing keeps the model alive (a weak mapping), and :func:`release` frees it at once.

Kept only where a replay is valid for another prompt: greedy decoding (a sampling generator's state would need
re-seeding inside the graph) outside ``retrofit.sparse_decoding`` (a sparse session's layers are rebuilt on reset,
and its methods may size their selections from the prompt).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from retrofit.generation.engine import StaticGeneration
from retrofit.generation.graphs import CapturedStep, free_capture_workspaces


@dataclass
class KeptGeneration:
    key: tuple
    generation: StaticGeneration
    captured: CapturedStep | None


_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, KeptGeneration]" = weakref.WeakKeyDictionary()


def reuse_key(model, generation_options: tuple) -> tuple:
    """What a kept state must match besides the batch's shape: the options of the step and the weights' storage
    (a graph reads the parameters at their addresses; ``model.to(...)`` moves them)."""
    weights = tuple(parameter.data_ptr() for parameter in model.parameters())
    return (generation_options, getattr(model.config, "_attn_implementation", None), weights)


def take(model, key: tuple | None, input_ids: torch.Tensor, max_new_tokens: int) -> KeptGeneration | None:
    """The kept state of ``model``, handed back to it, if it fits this call (the caller keeps it again when done);
    otherwise None, the kept state freed first so that its cache is gone before a new one is allocated. ``key``
    None: a call that must not reuse (sampling, a sparse session)."""
    kept = _KEPT.get(model)
    if kept is not None and key is not None and kept.key == key and kept.generation.can_load(input_ids, max_new_tokens):
        del _KEPT[model]
        kept.generation.model = model
        return kept
    release(model)
    return None


def keep(model, kept: KeptGeneration) -> None:
    kept.generation.model = None  # the mapping must not keep the model alive; `take` hands it back
    _KEPT[model] = kept


def release(model) -> bool:
    """Free the static cache and the captured graph kept for ``model``; True if there was one."""
    kept = _KEPT.pop(model, None)
    if kept is None:
        return False
    device = kept.generation.device
    del kept
    _free_device_cache(device)
    return True


def captured_and_dropped(device: torch.device) -> None:
    """After a call that captured a decode step it does not keep: free what the capture left behind (cuBLAS
    workspaces, :func:`~retrofit.generation.graphs.free_capture_workspaces`) when no kept graph could need it."""
    if not _KEPT:
        free_capture_workspaces(device)


def kept_generation(model) -> KeptGeneration | None:
    """The state kept for ``model`` (None if none), e.g. to check which buffers the next call will reuse."""
    return _KEPT.get(model)


def _free_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        if not _KEPT:  # no kept graph left that a capture's workspace could serve
            free_capture_workspaces(device)
        torch.cuda.empty_cache()
