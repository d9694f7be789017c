"""The bytes floor of a decode step: the bytes a step must read, over the copy bandwidth measured in the same run.

A decode step reads every weight once (the input embedding only in its B rows, unless tied to the output layer) and
what each layer's cache holds for the step: the keys and values of every valid position for dense attention, the
selected tokens plus the method's metadata for a sparse layer (:meth:`SparseMethod.step_read_bytes`), the conv and
recurrent states for a linear-attention layer. Nothing can decode faster than moving those bytes once at the
device's copy bandwidth; the ratio of a measured step to it says how far from the memory-bandwidth floor it is.
"""
from __future__ import annotations

import statistics
import time

import torch

from retrofit.sparse.cache import SparseLayer


def copy_bandwidth(device: torch.device, megabytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` on ``device`` (read + write counted), the median of
    ``repeats`` copies of ``megabytes`` (default 2048 on CUDA, 256 elsewhere: past the caches) after a warm-up."""
    megabytes = megabytes or (2048 if device.type == "cuda" else 256)
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        began = time.perf_counter()
        target.copy_(source)
        _synchronize(device)
        seconds.append(time.perf_counter() - began)
    return 2 * source.numel() / statistics.median(seconds)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_read(model) -> int:
    """Bytes of the weights one decode step reads: every parameter storage once, except an input embedding that is
    not also the output layer (a step reads only its rows)."""
    embedding = model.get_input_embeddings().weight
    tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen or (parameter is embedding and not tied):
            continue
        seen.add(parameter.data_ptr())
        total += parameter.numel() * parameter.element_size()
    return total


def cache_bytes_read(cache, valid_tokens: int) -> int:
    """Bytes a decode step reads from ``cache`` when each row holds ``valid_tokens`` positions."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SparseLayer):
            total += layer.method.step_read_bytes(layer, valid_tokens)
        elif getattr(layer, "recurrent_states", None) is not None:  # linear attention: its states, whatever the length
            for states in (layer.conv_states, layer.recurrent_states):
                total += sum(t.numel() * t.element_size() for t in states.values() if isinstance(t, torch.Tensor))
        elif isinstance(getattr(layer, "keys", None), torch.Tensor):  # dense attention: every valid key and value
            keys, values = layer.keys, layer.values
            per_token = (keys[:, :, :1].numel() * keys.element_size() + values[:, :, :1].numel() * values.element_size())
            total += per_token * valid_tokens
    return total


def floor_seconds(model, cache, valid_tokens: int, bandwidth: float) -> float:
    """The bytes floor of one decode step, in seconds."""
    return (weight_bytes_read(model) + cache_bytes_read(cache, valid_tokens)) / bandwidth
