"""The bytes a KV/state cache actually holds (the peak memory of a measured region is
:class:`retrofit.memory.MemoryProbe`'s)."""
from __future__ import annotations

import torch


def _tensors(obj, seen_objects: set, depth: int = 0):
    """Every tensor reachable from ``obj`` through dicts, lists, tuples and plain objects' attributes (not modules)."""
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if id(obj) in seen_objects:
        return
    seen_objects.add(id(obj))
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _tensors(child, seen_objects, depth + 1)


def tensor_bytes(obj) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj`` (a transformers Cache, its layers, lists,
    dicts and attributes; each storage counted once). This is what the cache really holds, metadata included."""
    storages: set = set()
    total = 0
    for tensor in _tensors(obj, set()):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        if key not in storages:
            storages.add(key)
            total += storage.nbytes()
    return total


def reachable_tensors(obj) -> set[tuple]:
    """(identity, address, shape, dtype) of every tensor reachable from ``obj``: equal before and after some work
    when the work allocated no new tensor for ``obj`` to hold and replaced none (it updated them in place)."""
    return {(id(t), t.data_ptr(), tuple(t.shape), t.dtype) for t in _tensors(obj, set())}
