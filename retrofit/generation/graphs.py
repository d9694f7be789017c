"""A decode step captured once as a CUDA graph and replayed (CUDA only; the CPU runs the same step eagerly).

The step of :class:`retrofit.generation.engine.StaticGeneration` reads and writes only tensors allocated before it
(cache, tokens, positions, output, flags), issues the same operations every time and never synchronises with the
host, so ``torch.cuda.CUDAGraph`` can record it (every layer, the sparse selection, the sampling) and replay it as
one launch per token. Temporaries of the step live in the graph's private memory pool: a replay allocates nothing.

Capture needs warmed-up kernels (Triton compiles, cuBLAS creates its handles on first use): the caller runs at
least one step eagerly first, on a side stream as PyTorch recommends. Capturing records without executing, so the
captured step does not advance the decode; every replay does.
"""
from __future__ import annotations

from typing import Callable

import torch


def free_capture_workspaces(device: torch.device) -> None:
    """Free the cuBLAS workspaces PyTorch keeps after CUDA-graph captures: one more (32 MiB on Hopper) per capture,
    so a sparse session's calls, each capturing its own decode step, held 32 MiB more after every call (measured on
    an H200; flat when freed). Call it only while no kept graph could replay over one (:mod:`retrofit.generation.kept`
    checks that none is kept)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if torch.device(device).type == "cuda" and clear is not None:
        clear()


def warm_up(step: Callable[[], None], device: torch.device) -> None:
    """Run ``step`` once eagerly on a side stream (what capture needs first), then join the current stream."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)


class CapturedStep:
    """``step`` recorded once in a CUDA graph; :meth:`replay` runs it. ``generator``: the sampling generator, whose
    state the graph must advance on every replay (registered with the graph)."""

    def __init__(self, step: Callable[[], None], device: torch.device, generator: torch.Generator | None = None):
        self.graph = torch.cuda.CUDAGraph()
        if generator is not None:
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph):
            step()
        self.device = device

    def replay(self) -> None:
        self.graph.replay()
