"""Pure-PyTorch short causal depthwise convolution: the specification the Triton kernels are tested against.

Convention (the one of ``causal_conv1d`` / Mamba / Gated DeltaNet layers): for channel ``d``,

    y[b, t, d] = act(bias[d] + sum_{w < W} weight[d, w] * x[b, t + w - (W - 1), d])

so ``weight[:, W - 1]`` multiplies the current input. Positions before the start read the
``initial_state`` ``[B, D, W - 1]`` (the last ``W - 1`` inputs of the previous segment, oldest first),
or zeros. The final state is the last ``W - 1`` inputs (again oldest first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return z
    if activation in ("silu", "swish"):
        return F.silu(z)
    raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv over time, computed in float32 (differentiable through autograd).

    Args:
        x: ``[B, T, D]``.
        weight: ``[D, W]``.
        bias: ``[D]`` or None.
        activation: ``"silu"`` or None.
        initial_state: ``[B, D, W - 1]`` inputs before position 0 (zeros when None).
        output_final_state: also return the last ``W - 1`` inputs ``[B, D, W - 1]``.

    Returns:
        ``(y [B, T, D] in x's dtype, final_state [B, D, W - 1] in x's dtype or None)``.
    """
    B, T, D = x.shape
    W = weight.shape[1]
    if initial_state is None:
        prefix = x.new_zeros(B, W - 1, D)
    else:
        prefix = initial_state.transpose(1, 2).to(x.dtype)
    padded = torch.cat([prefix, x], dim=1)  # [B, W - 1 + T, D]
    z = torch.zeros(B, T, D, dtype=torch.float32, device=x.device)
    for w in range(W):
        z = z + weight[:, w].float() * padded[:, w:w + T].float()
    if bias is not None:
        z = z + bias.float()
    y = _activate(z, activation).to(x.dtype)
    final_state = padded[:, padded.shape[1] - (W - 1):].transpose(1, 2) if output_final_state else None
    return y, final_state


def naive_causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step: ``x`` ``[B, D]`` or ``[B, 1, D]``; rolls ``conv_state`` ``[B, D, W - 1]`` in place.

    Returns ``y`` with ``x``'s shape and dtype.
    """
    x_step = x.reshape(x.shape[0], x.shape[-1])
    window = torch.cat([conv_state.to(x.dtype), x_step[:, :, None]], dim=-1)  # [B, D, W]
    z = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        z = z + bias.float()
    y = _activate(z, activation).to(x.dtype)
    conv_state.copy_(window[:, :, 1:])
    return y.reshape(x.shape)
