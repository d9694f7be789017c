"""Facts about the device a kernel launches on, shared by the launch heuristics of the kernel folders."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _multiprocessors_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None elsewhere (the CPU interpreter has no occupancy to fill)."""
    if device.type != "cuda":
        return None
    return _multiprocessors_of(device.index if device.index is not None else torch.cuda.current_device())
