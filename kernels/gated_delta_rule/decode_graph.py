"""One recurrent decode step (T = 1) captured in a CUDA graph, for static shapes.

A plain launch of the recurrent kernel costs tens of microseconds of host time (argument checks,
Triton's launcher); the GPU work of one step at B=1, H=32, K=V=128 is a few microseconds. Replaying
a captured graph removes the host cost. The graph owns static input buffers and a static output;
the state is the caller's float32 tensor, updated in place on every replay.

Usage::

    state = torch.zeros(B, H, K, V, device="cuda")           # or a prefill's final state
    step = RecurrentDecodeGraph(state, num_query_heads=HQ)   # GDN; per_key_decay=True for KDA
    for ...:
        o = step(q, k, v, g, beta)     # copies into the static buffers, replays, returns step.o
    # or write straight into step.q / step.k / step.v / step.g / step.beta and call step.replay()
"""

from __future__ import annotations

import torch

from ..kda.fused_recurrent import fused_recurrent_kda
from .fused_recurrent import fused_recurrent_gated_delta_rule


class RecurrentDecodeGraph:
    """A captured decode step of ``fused_recurrent_gated_delta_rule`` (or ``fused_recurrent_kda``).

    Args:
        state: ``[B, H, K, V]`` contiguous float32 CUDA tensor; updated in place by every replay.
        num_query_heads: ``H_q`` (a multiple of ``H``; GQA), default ``H``.
        per_key_decay: False for GDN (``g`` ``[B, 1, H]``), True for KDA (``g`` ``[B, 1, H, K]``).
        dtype: dtype of the static ``q``, ``k``, ``v`` buffers and of the output.
        gate_dtype: dtype of the static ``g`` and ``beta`` buffers.
        scale: output scale, default ``K ** -0.5``.

    Attributes ``q`` ``[B, 1, H_q, K]``, ``k`` ``[B, 1, H, K]``, ``v`` ``[B, 1, H, V]``, ``g``, ``beta``
    ``[B, 1, H]`` are the static inputs; ``o`` ``[B, 1, H_q, V]`` is the static output (overwritten by
    the next replay: clone it to keep it).
    """

    def __init__(
        self,
        state: torch.Tensor,
        num_query_heads: int | None = None,
        *,
        per_key_decay: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        gate_dtype: torch.dtype = torch.float32,
        scale: float | None = None,
    ) -> None:
        if state.ndim != 4 or not state.is_cuda or state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError(
                f"RecurrentDecodeGraph: state must be a contiguous float32 CUDA tensor [B, H, K, V], "
                f"got {state.dtype} {tuple(state.shape)} on {state.device}"
            )
        B, H, K, V = state.shape
        HQ = H if num_query_heads is None else num_query_heads
        if HQ % H != 0:
            raise ValueError(f"RecurrentDecodeGraph: num_query_heads={HQ} is not a multiple of the state's {H} heads")
        self.state = state
        self.scale = scale
        self._op = fused_recurrent_kda if per_key_decay else fused_recurrent_gated_delta_rule
        device = state.device
        # zeros make the warm-up step a padded position (g = 0, beta = 0, k = 0): it leaves the state unchanged
        self.q = torch.zeros(B, 1, HQ, K, dtype=dtype, device=device)
        self.k = torch.zeros(B, 1, H, K, dtype=dtype, device=device)
        self.v = torch.zeros(B, 1, H, V, dtype=dtype, device=device)
        self.g = torch.zeros((B, 1, H, K) if per_key_decay else (B, 1, H), dtype=gate_dtype, device=device)
        self.beta = torch.zeros(B, 1, H, dtype=gate_dtype, device=device)

        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._run()  # compiles the kernel outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.o = self._run()

    def _run(self) -> torch.Tensor:
        o, _ = self._op(self.q, self.k, self.v, self.g, self.beta, scale=self.scale,
                        initial_state=self.state, inplace_state=True)
        return o

    def replay(self) -> torch.Tensor:
        """Run the captured step on the current contents of the static inputs; returns ``self.o``."""
        self.graph.replay()
        return self.o

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor) -> torch.Tensor:
        """Copy one token's inputs (shapes of the static buffers) in, replay, return ``self.o`` ``[B, 1, H_q, V]``."""
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)
        self.g.copy_(g)
        self.beta.copy_(beta)
        return self.replay()
