"""Peak memory really allocated during a measured region, on CUDA (allocator statistics) or the CPU (RSS),
and the bytes a KV/state cache actually holds."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the process's VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    rss = _status_kib("VmRSS")
    if rss is not None:
        return rss * 1024
    import psutil  # not Linux: psutil is the portable fallback

    return psutil.Process().memory_info().rss


@dataclass
class PeakMemory:
    """``peak`` = highest bytes in use during the region (CUDA: allocated tensors; CPU: process RSS);
    ``baseline`` = bytes in use when it began (weights etc.); ``delta = peak - baseline``."""

    baseline: int = 0
    peak: int = 0
    kind: str = ""

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.baseline)


class MemoryProbe:
    """``with MemoryProbe(device) as probe: ...`` then ``probe.result`` (a :class:`PeakMemory`).

    On the CPU the high-water mark is for the whole process, so the probe resets it at the start when the kernel
    allows (clear_refs); otherwise the peak is at least the HWM before the region and the delta may read 0."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.result = PeakMemory()

    def __enter__(self) -> "MemoryProbe":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.result = PeakMemory(baseline=torch.cuda.memory_allocated(self.device), kind="cuda allocated")
        else:
            _reset_peak_rss()
            self.result = PeakMemory(baseline=current_rss_bytes(), kind="process RSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            hwm = _status_kib("VmHWM")
            self.result.peak = hwm * 1024 if hwm is not None else current_rss_bytes()


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
