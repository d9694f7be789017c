"""Helpers shared by the tests: relative RMS error and NaN poisoning of fresh buffers."""
from __future__ import annotations

import contextlib

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the absolute error ||a - b|| when b is all zeros)."""
    a = a.detach().to(torch.float64)
    b = b.detach().to(torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"rel_rms: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    num = (a - b).norm().item()
    den = b.norm().item()
    return num / den if den > 0 else num


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a floating-point tensor with NaN in place (outputs a kernel must overwrite); returns it."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


@contextlib.contextmanager
def nan_poisoned_allocations():
    """Within the block, torch.empty / torch.empty_like return NaN-filled floating-point tensors, so that a
    kernel reading memory it never wrote (or leaving part of an output unwritten) shows up as NaN."""
    orig_empty, orig_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        return poison_(orig_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return poison_(orig_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = orig_empty, orig_empty_like


poisoned_empty = nan_poisoned_allocations


class AllocationCap:
    """A per-allocation limit on tensors made by PyTorch operators, as a device of ``limit`` bytes would impose:
    within ``with cap:`` an operator whose output is a new storage of more than ``limit`` bytes raises
    ``torch.OutOfMemoryError`` with the CPU allocator's words; ``limit`` None only records ``largest``, the largest
    new storage seen (views and in-place results, which allocate nothing, are not counted). ``raised`` counts the
    refusals."""

    def __init__(self, limit: int | None = None):
        self.limit, self.largest, self.raised = limit, 0, 0

    def __enter__(self) -> "AllocationCap":
        from torch.utils._python_dispatch import TorchDispatchMode

        cap = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                cap._check(out, args, kwargs or {})
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def _check(self, out, args, kwargs) -> None:
        from torch.utils._pytree import tree_leaves

        existing = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in existing:
                continue
            size = storage.nbytes()
            self.largest = max(self.largest, size)
            if self.limit is not None and size > self.limit:
                self.raised += 1
                raise torch.OutOfMemoryError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                             f"{size} bytes. Error code 12 (Cannot allocate memory)")


@contextlib.contextmanager
def allocations_capped_in(owner, name: str, limit: int = 0, when=lambda *args, **kwargs: True):
    """Within the block, calls of ``owner.name`` (a method or function) for which ``when(*args, **kwargs)`` holds
    run under ``AllocationCap(limit)``: their first allocation over ``limit`` bytes raises torch.OutOfMemoryError.
    Yields the list of the caps applied."""
    original = getattr(owner, name)
    caps: list[AllocationCap] = []

    def capped(*args, **kwargs):
        if not when(*args, **kwargs):
            return original(*args, **kwargs)
        cap = AllocationCap(limit)
        caps.append(cap)
        with cap:
            return original(*args, **kwargs)

    setattr(owner, name, capped)
    try:
        yield caps
    finally:
        setattr(owner, name, original)


KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def graph_replay_counts(model, ids: torch.Tensor, mask: torch.Tensor, fuse_layers: bool, steps: int = 32):
    """Decode ``steps`` tokens of ``model`` on CUDA by graph replays after the eager step, the capture and a first
    replay -> (allocations those steps made, ``cudaGraphLaunch`` calls, kernel launches outside a graph)."""
    from torch.profiler import ProfilerActivity, profile

    from retrofit.generation import DecodeLoop, SamplingOptions, StaticGeneration
    from retrofit.generation.sampling import TokenChooser

    with torch.no_grad():
        generation = StaticGeneration(model, ids, mask, 64, TokenChooser(SamplingOptions(), ids.device), [], 0,
                                      fuse_layers=fuse_layers)
        loop = DecodeLoop(generation, use_graph=True)
        with generation.installed():
            generation.prefill()
            loop.run(3, stop_at_end=False)  # eager step, capture, first replay
            torch.cuda.synchronize()
            allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loop.run(steps, stop_at_end=False)
                torch.cuda.synchronize()
            allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - allocations
    calls = {event.key: event.count for event in prof.key_averages()}
    return allocated, calls.get("cudaGraphLaunch", 0), sum(calls.get(key, 0) for key in KERNEL_LAUNCH_CALLS)
