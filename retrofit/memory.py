"""Memory: what a device has free, the peak a region of work reached, and running out of it as one line.

Out of memory is something a user meets with a setting that is too large for the machine (a batch, a context
length, a number of seeds), so every command reports it as bad input is reported: one line on stderr, exit code 2,
naming the device, what did not fit and what to try, never a traceback. :func:`reported` turns an out-of-memory
error raised inside a block into that line (:class:`OutOfMemory`, a :class:`RetrofitError`); the ``retrofit``
command group does it for any command that did not name its work more precisely. The error a device raises is
recognised in its forms: ``torch.OutOfMemoryError`` (CUDA's caching allocator), a ``RuntimeError`` from the CPU's
allocator ("can't allocate memory") and from cuBLAS / cuDNN / MPS allocations.

    with reported("evaluating quest@1024 on passkey@8000 at batch 32", advice="a smaller --batch-size"):
        ...
"""
from __future__ import annotations

import contextlib
import gc
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from retrofit.errors import RetrofitError

GIB = 1024 ** 3
_MESSAGES = ("out of memory", "can't allocate memory", "Cannot allocate memory", "CUBLAS_STATUS_ALLOC_FAILED",
             "CUDNN_STATUS_ALLOC_FAILED", "CUDNN_STATUS_NOT_ENOUGH_MEMORY")
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
PROCESS_PEAK_RSS = "max RSS of the process"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says a device (or the host) had no memory left for an allocation."""
    torch = sys.modules.get("torch")  # no torch loaded: no torch allocation can have failed
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(message in str(error) for message in _MESSAGES)


def allocation_detail(error: BaseException) -> tuple[str | None, str]:
    """(the device named in ``error``'s message or None, a short account of the failed allocation), e.g.
    ``("cuda:0", "tried to allocate 18.00 GiB; 61.02 GiB allocated of 79.19 GiB")``."""
    text = str(error)
    cuda = re.search(r"Tried to allocate ([\d.]+ \w+)\. GPU (\d+) has a total capacity of ([\d.]+ \w+)", text)
    if cuda:
        held = re.search(r"([\d.]+ \w+) is allocated by PyTorch", text)
        tail = f"; {held.group(1)} allocated of {cuda.group(3)}" if held else f" of {cuda.group(3)}"
        return f"cuda:{cuda.group(2)}", f"tried to allocate {cuda.group(1)}{tail}"
    cpu = re.search(r"you tried to allocate (\d+) bytes", text)
    if cpu:
        return "cpu", f"tried to allocate {int(cpu.group(1)) / GIB:.2f} GiB"
    first = " ".join(text.split())[:120]
    return None, first or type(error).__name__


class OutOfMemory(RetrofitError):
    """Out of memory as one line: ``out of memory on DEVICE (DETAIL) while WHAT: try ADVICE``. ``what`` and
    ``advice`` may be filled in by an outer layer that knows them (the command group adds the command's advice)."""

    def __init__(self, device: str | None, detail: str, what: str | None = None, advice: str | None = None):
        super().__init__(detail)
        self.device, self.detail, self.what, self.advice = device, detail, what, advice

    def __str__(self) -> str:
        line = "out of memory" + (f" on {self.device}" if self.device else "")
        line += (f" ({self.detail})" if self.detail else "") + (f" while {self.what}" if self.what else "")
        return line + (f": try {self.advice}" if self.advice else "")


def out_of_memory(error: BaseException, what: str | None = None, advice: str | None = None,
                  device: object = None) -> OutOfMemory:
    """The one-line :class:`OutOfMemory` for an out-of-memory ``error`` (``device``: where the work ran, if the
    message does not say)."""
    named, detail = allocation_detail(error)
    return OutOfMemory(named or (str(device) if device is not None else None), detail, what, advice)


@contextlib.contextmanager
def reported(what: str, advice: str | None = None, device: object = None) -> Iterator[None]:
    """Within the block, an out-of-memory error becomes :class:`OutOfMemory` naming ``what`` and ``advice``; an
    :class:`OutOfMemory` from an inner block (which named its work more precisely) passes unchanged, as does
    anything else. The original error is dropped before the new one is raised, so the tensors its traceback held are
    free by then."""
    failure = None
    try:
        yield
    except BaseException as error:  # noqa: BLE001 - re-raised unless it is an out-of-memory error
        if isinstance(error, OutOfMemory) or not is_out_of_memory(error):
            raise
        failure = out_of_memory(error, what, advice, device)
    if failure is not None:
        raise failure


def release_memory(device: object = None) -> None:
    """Free what unreachable objects still hold, and on CUDA hand the allocator's cached blocks back, so that the
    next allocation (a retry at a smaller size, the next variant) starts from what is really in use."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        torch.cuda.empty_cache()


def available_bytes(device) -> int | None:
    """Bytes a new allocation can take on ``device`` now: on CUDA the driver's free memory plus the allocator's
    cached, unused blocks; on the CPU the kernel's ``MemAvailable``; None where it cannot be read."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_memory(device=None) -> bool:
    """Start a new peak for :func:`peak_memory_so_far`: CUDA's allocation statistics of a CUDA ``device``, else the
    process's VmHWM, set to its current RSS (Linux >= 4.0: write 5 to clear_refs). False where the kernel does not
    allow it: the peak then stays at least the high-water mark before."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
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


def peak_memory_so_far(device=None) -> tuple[int, str]:
    """``(bytes, measure)``: the peak memory since the statistics were last reset. On a CUDA ``device`` (or, with
    none given, in a process that has used CUDA: its current device) the peak of tensors allocated there
    (``torch.cuda.reset_peak_memory_stats`` resets it); otherwise the process's maximum resident set size."""
    import torch

    if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is not None and torch.device(device).type == "cuda":
        device = torch.device(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        return int(torch.cuda.max_memory_allocated(index)), f"torch.cuda.max_memory_allocated(cuda:{index})"
    from retrofit.devices import peak_rss_bytes

    return peak_rss_bytes(), PROCESS_PEAK_RSS


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

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.result = PeakMemory()

    def __enter__(self) -> "MemoryProbe":
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.result = PeakMemory(baseline=torch.cuda.memory_allocated(self.device), kind="cuda allocated")
        else:
            reset_peak_memory()
            self.result = PeakMemory(baseline=current_rss_bytes(), kind="process RSS")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.result.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            from retrofit.devices import peak_rss_bytes

            self.result.peak = peak_rss_bytes()
