"""Short causal depthwise convolution: Triton prefill (differentiable) and decode step, with the PyTorch reference."""

from .causal_conv1d import causal_conv1d, causal_conv1d_update
from .reference import naive_causal_conv1d, naive_causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d", "naive_causal_conv1d_update"]
