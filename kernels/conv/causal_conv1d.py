"""Short causal depthwise convolution (kernel width ``W``, typically 4) in Triton: prefill and decode.

Same convention as ``reference.py`` beside it (``weight[:, W - 1]`` multiplies the current
input; the state holds the last ``W - 1`` inputs, oldest first). Prefill (``causal_conv1d``) is
differentiable in ``x``, ``weight``, ``bias`` and ``initial_state``; its backward is two Triton
kernels (recompute the pre-activation and form ``dz``, ``dweight``/``dbias`` partial sums per time
block; then ``dx`` as the transposed convolution of ``dz``), plus a few small PyTorch ops for
``d initial_state`` and the final state. Decode (``causal_conv1d_update``) is inference only and
rolls the state in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation

_ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _conv_tap(x, init, i_b, offs_t, offs_d, mask_d, shift, T, D, W: tl.constexpr, HAS_INIT: tl.constexpr):
    """x at positions ``offs_t + shift`` ([BT, BD], float32), reading ``init`` before position 0."""
    src = offs_t + shift
    in_x = (src >= 0) & (src < T)
    vals = tl.load(x + (i_b * T + src[:, None]) * D + offs_d[None, :],
                   mask=in_x[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        in_init = (src < 0) & (src >= -(W - 1))
        slot = src + (W - 1)  # oldest state entry is slot 0
        vals += tl.load(init + (i_b * D + offs_d[None, :]) * (W - 1) + slot[:, None],
                        mask=in_init[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    return vals


@triton.jit
def _preactivation(x, weight, bias, init, i_b, offs_t, offs_d, mask_d, T, D,
                   W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr):
    z = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        w_col = tl.load(weight + offs_d * W + w, mask=mask_d, other=0.0).to(tl.float32)
        z += _conv_tap(x, init, i_b, offs_t, offs_d, mask_d, w - (W - 1), T, D, W, HAS_INIT) * w_col[None, :]
    if HAS_BIAS:
        z += tl.load(bias + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def causal_conv1d_fwd_kernel(
    x, weight, bias, init, y, T, D,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
):
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    z = _preactivation(x, weight, bias, init, i_b, offs_t, offs_d, mask_d, T, D, W, BT, BD, HAS_BIAS, HAS_INIT)
    if SILU:
        z = z * tl.sigmoid(z)
    mask = (offs_t < T)[:, None] & mask_d[None, :]
    tl.store(y + (i_b * T + offs_t[:, None]) * D + offs_d[None, :], z.to(y.dtype.element_ty), mask=mask)


@triton.jit
def causal_conv1d_bwd_dz_kernel(
    x, weight, bias, init, dy, dz, dweight_part, dbias_part, T, D, NT,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
):
    """dz = dy * act'(z) (float32), and per-(batch, time block) partial sums of dweight [D, W] and dbias [D]."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    mask = (offs_t < T)[:, None] & mask_d[None, :]
    grad = tl.load(dy + (i_b * T + offs_t[:, None]) * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if SILU:
        z = _preactivation(x, weight, bias, init, i_b, offs_t, offs_d, mask_d, T, D, W, BT, BD, HAS_BIAS, HAS_INIT)
        sig = tl.sigmoid(z)
        grad = grad * sig * (1.0 + z * (1.0 - sig))
    tl.store(dz + (i_b * T + offs_t[:, None]) * D + offs_d[None, :], grad, mask=mask)
    part = i_b * NT + i_t
    for w in tl.static_range(W):
        tap = _conv_tap(x, init, i_b, offs_t, offs_d, mask_d, w - (W - 1), T, D, W, HAS_INIT)
        tl.store(dweight_part + (part * D + offs_d) * W + w, tl.sum(grad * tap, axis=0), mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_part + part * D + offs_d, tl.sum(grad, axis=0), mask=mask_d)


@triton.jit
def causal_conv1d_bwd_dx_kernel(
    dz, weight, dx, T, D,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):
    """dx[t] = sum_w weight[:, w] * dz[t + (W - 1) - w] (the transposed convolution)."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    offs_t = i_t * BT + tl.arange(0, BT)
    offs_d = i_d * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        src = offs_t + (W - 1 - w)
        w_col = tl.load(weight + offs_d * W + w, mask=mask_d, other=0.0).to(tl.float32)
        vals = tl.load(dz + (i_b * T + src[:, None]) * D + offs_d[None, :],
                       mask=(src < T)[:, None] & mask_d[None, :], other=0.0)
        acc += vals * w_col[None, :]
    mask = (offs_t < T)[:, None] & mask_d[None, :]
    tl.store(dx + (i_b * T + offs_t[:, None]) * D + offs_d[None, :], acc.to(dx.dtype.element_ty), mask=mask)


@triton.jit
def causal_conv1d_update_kernel(
    x, state, weight, bias, y, D, x_row_stride,
    W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    i_d = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    offs_d = i_d * BD + tl.arange(0, BD)
    offs_w = tl.arange(0, BW)
    mask_d = offs_d < D
    in_state = offs_w < W - 1
    base = state + (i_b * D + offs_d[:, None]) * (W - 1)
    window = tl.load(base + offs_w[None, :], mask=mask_d[:, None] & in_state[None, :], other=0.0).to(tl.float32)
    shifted = tl.load(base + offs_w[None, :] + 1, mask=mask_d[:, None] & (offs_w < W - 2)[None, :],
                      other=0.0)
    x_now = tl.load(x + i_b * x_row_stride + offs_d, mask=mask_d, other=0.0)
    w_state = tl.load(weight + offs_d[:, None] * W + offs_w[None, :],
                      mask=mask_d[:, None] & in_state[None, :], other=0.0).to(tl.float32)
    w_now = tl.load(weight + offs_d * W + (W - 1), mask=mask_d, other=0.0).to(tl.float32)
    z = tl.sum(window * w_state, axis=1) + x_now.to(tl.float32) * w_now
    if HAS_BIAS:
        z += tl.load(bias + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if SILU:
        z = z * tl.sigmoid(z)
    tl.store(y + i_b * D + offs_d, z.to(y.dtype.element_ty), mask=mask_d)
    tl.debug_barrier()  # every thread has read the old state before any slot is overwritten
    rolled = tl.where((offs_w == W - 2)[None, :], x_now[:, None].to(state.dtype.element_ty),
                      shifted.to(state.dtype.element_ty))
    tl.store(base + offs_w[None, :], rolled, mask=mask_d[:, None] & in_state[None, :])


def _check_activation(activation: str | None) -> bool:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return activation is not None


_BT = 64


def _block_d(D: int) -> int:
    return min(128, triton.next_power_of_2(D))


class _CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, silu):
        B, T, D = x.shape
        W = weight.shape[1]
        BD = _block_d(D)
        y = torch.empty_like(x)
        grid = (triton.cdiv(T, _BT), triton.cdiv(D, BD), B)
        causal_conv1d_fwd_kernel[grid](
            x, weight, bias, initial_state, y, T, D,
            W=W, BT=_BT, BD=BD, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, SILU=silu,
        )
        ctx.save_for_backward(x, weight, bias, initial_state)
        ctx.silu = silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, initial_state = ctx.saved_tensors
        dy = dy.contiguous()
        B, T, D = x.shape
        W = weight.shape[1]
        BD = _block_d(D)
        NT = triton.cdiv(T, _BT)
        dz = torch.empty(B, T, D, dtype=torch.float32, device=x.device)
        dweight_part = torch.empty(B * NT, D, W, dtype=torch.float32, device=x.device)
        dbias_part = torch.empty(B * NT, D, dtype=torch.float32, device=x.device) if bias is not None else None
        grid = (NT, triton.cdiv(D, BD), B)
        causal_conv1d_bwd_dz_kernel[grid](
            x, weight, bias, initial_state, dy, dz, dweight_part, dbias_part, T, D, NT,
            W=W, BT=_BT, BD=BD, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, SILU=ctx.silu,
        )
        dx = torch.empty_like(x)
        causal_conv1d_bwd_dx_kernel[grid](dz, weight, dx, T, D, W=W, BT=_BT, BD=BD)
        dweight = dweight_part.sum(0).to(weight.dtype)
        dbias = dbias_part.sum(0).to(bias.dtype) if bias is not None else None
        dinit = None
        if initial_state is not None and ctx.needs_input_grad[3]:
            # state slot j sits at position j - (W - 1); it feeds outputs t = j - w for taps w <= j
            dinit = torch.zeros(B, D, W - 1, dtype=torch.float32, device=x.device)
            for j in range(W - 1):
                for w in range(j + 1):
                    if j - w < T:
                        dinit[:, :, j] += weight[:, w].float() * dz[:, j - w]
            dinit = dinit.to(initial_state.dtype)
        return dx, dweight, dbias, dinit, None


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise conv over time (prefill), Triton forward and backward.

    Args:
        x: ``[B, T, D]`` (fp32 or bf16).
        weight: ``[D, W]``; ``weight[:, W - 1]`` multiplies the current input.
        bias: ``[D]`` or None.
        activation: ``"silu"`` (or its alias ``"swish"``) or None.
        initial_state: ``[B, D, W - 1]`` the previous segment's last ``W - 1`` inputs, oldest first (zeros when None).
        output_final_state: also return this segment's last ``W - 1`` inputs.

    Returns:
        ``(y, final_state)``: ``y`` ``[B, T, D]`` in ``x``'s dtype; ``final_state`` ``[B, D, W - 1]`` in
        ``x``'s dtype, or None. Differentiable in ``x``, ``weight``, ``bias``, ``initial_state``
        (Triton backward: see the module docstring).
    """
    silu = _check_activation(activation)
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: x must be [B, T, D] and weight [D, W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    B, T, D = x.shape
    W = weight.shape[1]
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"causal_conv1d: bias must be [{D}], got {list(bias.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, D, W - 1):
        raise ValueError(f"causal_conv1d: initial_state must be {[B, D, W - 1]}, got {list(initial_state.shape)}")
    x = x.contiguous()
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    initial_state = initial_state.contiguous() if initial_state is not None else None
    # a width-1 conv has an empty state: nothing for the kernel to read
    kernel_state = initial_state if W > 1 else None
    y = _CausalConv1dFunction.apply(x, weight, bias, kernel_state, silu)
    final_state = None
    if output_final_state:
        prefix = x.new_zeros(B, D, W - 1) if initial_state is None else initial_state.to(x.dtype)
        recent = x[:, max(0, T - (W - 1)):].transpose(1, 2)
        final_state = torch.cat([prefix, recent], dim=-1)[:, :, prefix.shape[-1] + recent.shape[-1] - (W - 1):]
        final_state = final_state.contiguous()
    return y, final_state


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode step of the causal conv; rolls ``conv_state`` in place (inference only).

    Args:
        x: ``[B, D]`` or ``[B, 1, D]``, the new input; its rows may be spaced wider than ``D`` (a column block of a
            wider buffer, e.g. q, k and v in a merged projection's output) as long as its channels are contiguous.
        conv_state: ``[B, D, W - 1]`` contiguous, the last ``W - 1`` inputs (oldest first); on return it
            holds the window shifted by one with ``x`` as its newest entry.
        weight: ``[D, W]``.
        bias: ``[D]`` or None.
        activation: ``"silu"`` or None.

    Returns:
        ``y`` with ``x``'s shape and dtype.
    """
    silu = _check_activation(activation)
    D = x.shape[-1]
    B = x.shape[0]
    if not (x.ndim == 2 or (x.ndim == 3 and x.shape[1] == 1)):
        raise ValueError(f"causal_conv1d_update: x must be [B, D] or [B, 1, D], got {tuple(x.shape)}")
    W = weight.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != D or W < 2:
        raise ValueError(f"causal_conv1d_update: weight must be [{D}, W] with W >= 2, got {tuple(weight.shape)}")
    if tuple(conv_state.shape) != (B, D, W - 1) or not conv_state.is_contiguous():
        raise ValueError(f"causal_conv1d_update: conv_state must be a contiguous {[B, D, W - 1]} tensor, got {list(conv_state.shape)}")
    rows = x.reshape(B, D)  # a view for a column block of a wider buffer
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BD = _block_d(D)
    causal_conv1d_update_kernel[(triton.cdiv(D, BD), B)](
        rows, conv_state, weight, bias, y, D, rows.stride(0),
        W=W, BW=max(2, triton.next_power_of_2(W - 1)), BD=BD, HAS_BIAS=bias is not None, SILU=silu,
    )
    return y


def causal_conv1d(x, weight, bias=None, activation="silu", initial_state=None, output_final_state=False):
    """Causal depthwise conv over time (prefill): ``x [B, T, D]``, ``weight [D, W]`` -> ``(y [B, T, D], final state
    [B, D, W - 1] or None)``; arguments and returns as :func:`causal_conv1d_triton`. Triton or the PyTorch path
    (``reference.naive_causal_conv1d``) as ``retrofit.kernels.backend`` picks for ``x``'s device."""
    return implementation("causal_conv1d", x.device)(x, weight, bias, activation, initial_state, output_final_state)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation="silu"):
    """One decode step: ``x [B, D]`` or ``[B, 1, D]``, rolls ``conv_state [B, D, W - 1]`` in place -> ``y`` like ``x``;
    as :func:`causal_conv1d_update_triton`, on the backend ``retrofit.kernels.backend`` picks for ``x``'s device."""
    return implementation("causal_conv1d_update", x.device)(x, conv_state, weight, bias, activation)
