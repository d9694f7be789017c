"""What a decode step dispatches, counted deterministically: aten operations and host synchronisations.

On a GPU almost every aten operation of an eager step is a kernel launch (tens of microseconds of host time; views
and allocations are not, which ``kernels`` leaves out), and every read of a device value on the host (``.item()``,
``bool(tensor)``, ``nonzero``, a copy to the host) stalls the host until the device is done. Counted on the CPU,
through a ``TorchDispatchMode``, on a model whose compute is negligible, the counts are what a GPU would launch and
wait for, whatever the machine's load.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten operations that launch no kernel besides the views (``func.is_view``): allocations and metadata
NO_KERNEL_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view",
                           "_reshape_alias", "promote_types", "result_type", "lift_fresh", "set_", "resize_"})
# aten operations that read a tensor's value on the host (each one waits for the device)
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique", "_unique",
                      "_unique2", "unique_dim", "unique_consecutive"})


def _copies_to_host(func, args, kwargs) -> bool:
    """A copy from an accelerator to the CPU (``.cpu()``, ``.tolist()``, ``.numpy()`` of a device tensor)."""
    name = func.overloadpacket.__name__
    if name not in ("_to_copy", "copy_"):
        return False
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if name == "copy_":
        return len(tensors) >= 2 and tensors[0].device.type == "cpu" and tensors[1].device.type != "cpu"
    target = (kwargs or {}).get("device")
    return bool(tensors) and tensors[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu"


def signature(func, args, kwargs) -> tuple:
    """An operation with its tensors' shapes and dtypes and its other arguments: what a CUDA graph records."""
    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, tuple(value.stride()), value.storage_offset())
        if isinstance(value, (list, tuple)):
            return tuple(describe(item) for item in value)
        if isinstance(value, dict):
            return tuple(sorted((key, describe(item)) for key, item in value.items()))
        return value

    return (str(func), describe(args), describe(kwargs or {}))


def launches_kernel(func) -> bool:
    """Whether an aten operation runs a kernel on a GPU: not a view, not an allocation or a metadata query."""
    return not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL_OPS


class DispatchCount(TorchDispatchMode):
    """``with DispatchCount() as count: ...`` -> ``count.ops`` (aten operations), ``count.kernels`` (those that
    :func:`launches_kernel`), ``count.syncs`` (host reads of device values, :data:`SYNC_OPS` and copies to the host),
    ``count.sync_names``; with ``record`` the :func:`signature` of every operation in ``count.trace``."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.record = record
        self.ops = 0
        self.kernels = 0
        self.syncs = 0
        self.sync_names: Counter = Counter()
        self.trace: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.kernels += launches_kernel(func)
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or _copies_to_host(func, args, kwargs):
            self.syncs += 1
            self.sync_names[name] += 1
        if self.record:
            self.trace.append(signature(func, args, kwargs))
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class PerToken:
    """Aten operations (``kernels``: those that launch a kernel) and host synchronisations per decode token."""

    ops: float
    syncs: float
    sync_names: dict
    kernels: float = 0.0


def per_decode_token(generate: Callable[[int], Any], tokens: int = 32, base: int = 8) -> PerToken:
    """Counts of ``generate(max_new_tokens)`` at ``base + tokens`` minus at ``base`` new tokens, over ``tokens``:
    the cost of one more decode step, stop checks included and the prefill excluded (generation must not end
    early: no end-of-sequence token). One uncounted ``generate(base)`` first: a model's first call of a shape builds
    the cache that later calls keep (and on CUDA captures the step), which would otherwise count against the
    shorter run only (and make a replayed step's count negative)."""
    generate(base)
    with DispatchCount() as short:
        generate(base)
    with DispatchCount() as long:
        generate(base + tokens)
    names = {name: (long.sync_names[name] - short.sync_names[name]) / tokens for name in long.sync_names
             if long.sync_names[name] != short.sync_names[name]}
    return PerToken((long.ops - short.ops) / tokens, (long.syncs - short.syncs) / tokens, names,
                    (long.kernels - short.kernels) / tokens)


@contextlib.contextmanager
def triton_launches() -> Iterator[list[int]]:
    """``with triton_launches() as counter:`` counts Triton kernel launches (compiled or interpreted) in
    ``counter[0]``. A launch is hidden from the aten
    counts (the dispatch modes are off while it runs): the interpreter emulates a kernel with aten operations on the
    CPU (copies, storage swaps) that a GPU launch does not issue."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counter = [0]
    saved = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def counting(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                counter[0] += 1
            with _disable_current_modes():
                return original(self, *args, **kwargs)
        return run

    for cls, original in saved.items():
        cls.run = counting(original)
    try:
        yield counter
    finally:
        for cls, original in saved.items():
            cls.run = original
