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
