"""Device and dtype names as users type them (``--device``, ``--dtype``) -> torch objects, with one-line errors."""
from __future__ import annotations

import torch

from retrofit.errors import RetrofitError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``"bf16"``, ``"float32"``, a ``torch.dtype`` or None (float32) -> ``torch.dtype``."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise RetrofitError(f"unknown dtype {dtype!r}; choose from: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device | None) -> torch.device:
    """``"auto"``/None (CUDA when available), ``"cpu"``, ``"cuda:N"`` -> ``torch.device``; CUDA must be present."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise RetrofitError(f"unknown device {device!r} ({err})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise RetrofitError(f"device {device!r} was asked for but CUDA is not available on this machine")
    return parsed


def default_dtype(device: str | torch.device | None) -> str:
    """The dtype a command runs in when ``--dtype`` is not given: bfloat16 on CUDA, float32 elsewhere."""
    return "bfloat16" if parse_device(device).type == "cuda" else "float32"


def is_first_process() -> bool:
    """Rank 0 under torchrun (the ``RANK`` it sets: still readable after the process group has ended), or a lone
    process."""
    import os

    return int(os.environ.get("RANK", "0")) == 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: the kernel's high-water mark of its own address space
    (``VmHWM`` in ``/proc/self/status``). ``getrusage``'s ``ru_maxrss`` is only the fallback (macOS, no /proc): on
    Linux it also keeps the peak of the image a process replaced by exec, so a command started by a large parent
    (a test run holding models) would report the parent's memory as its own."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB, macOS bytes
