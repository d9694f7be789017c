"""Triton kernels for the sparse methods' per-step metadata upkeep, all over the block the decoded token joined:

- ``quest_page_update``: Quest's page bounds, the element-wise min and max of the page's keys, in place;
- ``pool_newest_block``: SeerAttention's pooled keys of the block (max, min, mean), which the gate's key projection
  turns into that block's gate key;
- ``seer_gate_key_update``: that gate key itself, in place: the pooling, the projection and the write in one kernel,
  where they were a pooling kernel, a GEMM and three small ops (the block's index and the scatter) per layer.

One program per (row, kv head) reads the block's keys once. Written as tensor operations each update was about twenty
small kernels per layer and decode step (the block's positions, their validity, masked reductions, zeros for a block
without a valid key, the scatters). Semantics: ``reference.quest_page_update_ref``, ``reference.pool_newest_block_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import implementation
from .attention import bounds_as_read


@triton.jit
def _newest_block_keys(keys_ptr, write_pos_ptr, start_ptr, end_ptr, stride_kb, stride_kh, stride_kn,
                       stride_start, stride_end, Hkv, N, D, block_size,
                       BLOCK_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's row ``b`` and kv head ``h`` and their keys in the block holding position ``write_pos - 1``:
    (b, h, block index, max, min and mean [BLOCK_D] fp32 over the valid positions (0 where there are none), the
    channel offsets and their mask)."""
    b = tl.program_id(0) // Hkv
    h = tl.program_id(0) % Hkv
    block = (tl.load(write_pos_ptr).to(tl.int64) - 1) // block_size
    kv_start = tl.load(start_ptr + b * stride_start).to(tl.int64)
    kv_end = tl.load(end_ptr + b * stride_end).to(tl.int64)
    offs = tl.arange(0, BLOCK_PAD)
    pos = block * block_size + offs
    valid = (offs < block_size) & (pos >= kv_start) & (pos < kv_end) & (pos < N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tile_ok = valid[:, None] & d_ok[None, :]
    keys = tl.load(keys_ptr + b * stride_kb + h * stride_kh + pos[:, None] * stride_kn + d[None, :],
                   mask=tile_ok, other=0.0).to(tl.float32)
    count = tl.sum(valid.to(tl.float32), 0)
    high = tl.max(tl.where(tile_ok, keys, float("-inf")), 0)
    low = tl.min(tl.where(tile_ok, keys, float("inf")), 0)
    high = tl.where(count > 0, high, 0.0)
    low = tl.where(count > 0, low, 0.0)
    mean = tl.sum(keys, 0) / tl.maximum(count, 1.0)
    return b, h, block, high, low, mean, d, d_ok


@triton.jit
def _quest_page_update_kernel(
    keys_ptr, min_ptr, max_ptr, write_pos_ptr, start_ptr, end_ptr,
    stride_kb, stride_kh, stride_kn, stride_mb, stride_mh, stride_mp, stride_xb, stride_xh, stride_xp,
    stride_start, stride_end, Hkv, N, D, page_size,
    BLOCK_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h, page, high, low, _, d, d_ok = _newest_block_keys(
        keys_ptr, write_pos_ptr, start_ptr, end_ptr, stride_kb, stride_kh, stride_kn, stride_start, stride_end,
        Hkv, N, D, page_size, BLOCK_PAD, BLOCK_D)
    tl.store(min_ptr + b * stride_mb + h * stride_mh + page * stride_mp + d, low.to(min_ptr.dtype.element_ty),
             mask=d_ok)
    tl.store(max_ptr + b * stride_xb + h * stride_xh + page * stride_xp + d, high.to(max_ptr.dtype.element_ty),
             mask=d_ok)


@triton.jit
def _pool_newest_block_kernel(
    keys_ptr, out_ptr, write_pos_ptr, start_ptr, end_ptr,
    stride_kb, stride_kh, stride_kn, stride_ob, stride_oh, stride_start, stride_end, Hkv, N, D, block_size,
    BLOCK_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b, h, _, high, low, mean, d, d_ok = _newest_block_keys(
        keys_ptr, write_pos_ptr, start_ptr, end_ptr, stride_kb, stride_kh, stride_kn, stride_start, stride_end,
        Hkv, N, D, block_size, BLOCK_PAD, BLOCK_D)
    out = out_ptr + b * stride_ob + h * stride_oh
    tl.store(out + d, high, mask=d_ok)
    tl.store(out + D + d, low, mask=d_ok)
    tl.store(out + 2 * D + d, mean, mask=d_ok)


@triton.jit
def _seer_gate_key_update_kernel(
    keys_ptr, gate_keys_ptr, weight_ptr, write_pos_ptr, start_ptr, end_ptr,
    stride_kb, stride_kh, stride_kn, stride_gb, stride_gh, stride_gn, stride_w, stride_start, stride_end,
    Hkv, N, D, block_size, hidden,
    BLOCK_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):
    b, h, block, high, low, mean, d, d_ok = _newest_block_keys(
        keys_ptr, write_pos_ptr, start_ptr, end_ptr, stride_kb, stride_kh, stride_kn, stride_start, stride_end,
        Hkv, N, D, block_size, BLOCK_PAD, BLOCK_D)
    # the pooled keys in the gate's dtype, as the projection reads them; channels past D (max -inf, min +inf) are 0,
    # since 0 weight times an infinity would be NaN
    out_ty = gate_keys_ptr.dtype.element_ty
    high = tl.where(d_ok, high, 0.0).to(out_ty).to(tl.float32)
    low = tl.where(d_ok, low, 0.0).to(out_ty).to(tl.float32)
    mean = mean.to(out_ty).to(tl.float32)
    out = gate_keys_ptr + b * stride_gb + h * stride_gh + block * stride_gn
    for j0 in range(0, hidden, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < hidden
        w_ok = j_ok[:, None] & d_ok[None, :]
        w_row = weight_ptr + j[:, None] * stride_w + d[None, :]
        w_high = tl.load(w_row, mask=w_ok, other=0.0).to(tl.float32)
        w_low = tl.load(w_row + D, mask=w_ok, other=0.0).to(tl.float32)
        w_mean = tl.load(w_row + 2 * D, mask=w_ok, other=0.0).to(tl.float32)
        gate_key = tl.sum(w_high * high[None, :] + w_low * low[None, :] + w_mean * mean[None, :], 1)
        tl.store(out + j, gate_key.to(out_ty), mask=j_ok)


def _tile_sizes(block_size: int, D: int) -> dict[str, int]:
    return dict(BLOCK_PAD=max(16, triton.next_power_of_2(block_size)), BLOCK_D=triton.next_power_of_2(D))


def quest_page_update_triton(keys: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor,
                             write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                             page_size: int) -> None:
    """Quest's metadata of the page holding position ``write_pos - 1``, in place: the Triton path of
    :func:`quest_page_update`.

    keys [B, Hkv, N, D], page_min/page_max [B, Hkv, P, D] (last dims contiguous), write_pos [1] int,
    kv_start/kv_end [B] int (any stride).
    """
    B, Hkv, N, D = keys.shape
    if keys.stride(-1) != 1 or page_min.stride(-1) != 1 or page_max.stride(-1) != 1:
        raise ValueError("the keys and the page metadata need a contiguous last dimension")
    if page_min.shape[:2] != (B, Hkv) or page_max.shape != page_min.shape or page_min.shape[-1] != D:
        raise ValueError(f"page metadata of shape {tuple(page_min.shape)} does not fit keys {tuple(keys.shape)}")
    kv_start, kv_end = bounds_as_read(kv_start), bounds_as_read(kv_end)
    _quest_page_update_kernel[(B * Hkv,)](
        keys, page_min, page_max, write_pos, kv_start, kv_end,
        keys.stride(0), keys.stride(1), keys.stride(2), page_min.stride(0), page_min.stride(1), page_min.stride(2),
        page_max.stride(0), page_max.stride(1), page_max.stride(2), kv_start.stride(0), kv_end.stride(0),
        Hkv, N, D, page_size, **_tile_sizes(page_size, D),
    )


def pool_newest_block_triton(keys: torch.Tensor, write_pos: torch.Tensor, kv_start: torch.Tensor,
                             kv_end: torch.Tensor, block_size: int) -> torch.Tensor:
    """The pooled keys of the block holding position ``write_pos - 1``: the Triton path of :func:`pool_newest_block`.

    keys [B, Hkv, N, D] (last dim contiguous), write_pos [1] int, kv_start/kv_end [B] int (any stride) ->
    [B, Hkv, 1, 3D] fp32.
    """
    B, Hkv, N, D = keys.shape
    if keys.stride(-1) != 1:
        raise ValueError("the keys need a contiguous last dimension")
    kv_start, kv_end = bounds_as_read(kv_start), bounds_as_read(kv_end)
    out = torch.empty(B, Hkv, 1, 3 * D, device=keys.device, dtype=torch.float32)
    _pool_newest_block_kernel[(B * Hkv,)](
        keys, out, write_pos, kv_start, kv_end,
        keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1),
        kv_start.stride(0), kv_end.stride(0), Hkv, N, D, block_size, **_tile_sizes(block_size, D),
    )
    return out


def seer_gate_key_update_triton(keys: torch.Tensor, gate_keys: torch.Tensor, weight: torch.Tensor,
                                write_pos: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor,
                                block_size: int) -> None:
    """The gate key of the block holding position ``write_pos - 1``, in place: the Triton path of
    :func:`seer_gate_key_update`.

    keys [B, Hkv, N, D], gate_keys [B, Hkv, NB, hidden], weight [hidden, 3D] (the gate's key projection, in the
    gate keys' dtype), all with a contiguous last dim; write_pos [1] int, kv_start/kv_end [B] int (any stride).
    """
    B, Hkv, N, D = keys.shape
    hidden = gate_keys.shape[-1]
    if keys.stride(-1) != 1 or gate_keys.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the keys, the gate keys and the projection need a contiguous last dimension")
    if gate_keys.shape[:2] != (B, Hkv) or tuple(weight.shape) != (hidden, 3 * D):
        raise ValueError(f"gate keys {tuple(gate_keys.shape)} and projection {tuple(weight.shape)} do not fit keys "
                         f"{tuple(keys.shape)}")
    kv_start, kv_end = bounds_as_read(kv_start), bounds_as_read(kv_end)
    _seer_gate_key_update_kernel[(B * Hkv,)](
        keys, gate_keys, weight, write_pos, kv_start, kv_end,
        keys.stride(0), keys.stride(1), keys.stride(2), gate_keys.stride(0), gate_keys.stride(1),
        gate_keys.stride(2), weight.stride(0), kv_start.stride(0), kv_end.stride(0), Hkv, N, D, block_size, hidden,
        BLOCK_J=32, **_tile_sizes(block_size, D),
    )


def quest_page_update(keys, page_min, page_max, write_pos, kv_start, kv_end, page_size):
    """keys [B, Hkv, N, D], page_min/page_max [B, Hkv, P, D], write_pos [1], kv_start/kv_end [B] -> None: the min and
    max over the valid keys of the page holding position ``write_pos - 1`` written into that page of
    page_min/page_max (0 where a row has no valid key there). Triton or ``reference.quest_page_update_ref``."""
    implementation("quest_page_update", keys.device)(keys, page_min, page_max, write_pos, kv_start, kv_end, page_size)


def pool_newest_block(keys, write_pos, kv_start, kv_end, block_size):
    """keys [B, Hkv, N, D], write_pos [1], kv_start/kv_end [B] -> [B, Hkv, 1, 3D] fp32: max, min and mean over the
    valid keys of the block of ``block_size`` positions holding position ``write_pos - 1`` (zeros where a row has
    none). Triton or ``reference.pool_newest_block_ref``."""
    return implementation("pool_newest_block", keys.device)(keys, write_pos, kv_start, kv_end, block_size)


def seer_gate_key_update(keys, gate_keys, weight, write_pos, kv_start, kv_end, block_size):
    """keys [B, Hkv, N, D], gate_keys [B, Hkv, NB, hidden], weight [hidden, 3D], write_pos [1], kv_start/kv_end [B]
    -> None: the gate key ``weight . pooled`` of the block holding position ``write_pos - 1`` (``pooled``: its
    :func:`pool_newest_block`, in the gate keys' dtype) written into that block of gate_keys. Triton or
    ``reference.seer_gate_key_update_ref``."""
    implementation("seer_gate_key_update", keys.device)(keys, gate_keys, weight, write_pos, kv_start, kv_end,
                                                        block_size)
