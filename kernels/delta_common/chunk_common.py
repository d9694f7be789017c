"""Triton helpers shared by the forward and backward kernels of the chunked gated delta rule (chunk.py):
the precision switch of the products and stores (PREC "ieee" / "tf32": fp32 operands; "bf16": bf16 operands
with fp32 accumulation; "bf16emu": the bf16 roundings reproduced under the CPU interpreter, whose bf16 tl.dot is
unusable) and GDN's causal decay matrix."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_bf16(x):
    """x (fp32) rounded to the nearest bf16 value (ties to even), kept in fp32: the interpreter's fp32 -> bf16
    conversion truncates, the GPU's rounds; "bf16emu" rounds with this instead."""
    xi = x.to(tl.uint32, bitcast=True)
    xi = (xi + 0x7FFF + ((xi >> 16) & 1)) & 0xFFFF0000
    return xi.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation. PREC "ieee" / "tf32": fp32 operands at that input precision; "bf16": bf16
    operands (tensor cores, bf16 inputs on the GPU); "bf16emu": the same bf16 rounding of the operands followed
    by an exact fp32 product (the interpreter's stand-in for "bf16", whose bf16 tl.dot is unusable)."""
    if PREC == "bf16":
        r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16emu":
        r = tl.dot(_round_bf16(a.to(tl.float32)), _round_bf16(b.to(tl.float32)), input_precision="ieee")
    else:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return r


@triton.jit
def _to_op(x, PREC: tl.constexpr):
    """x as a product operand: bf16 on the "bf16" path (rounded to the nearest bf16, kept fp32, on "bf16emu"),
    unchanged otherwise; casting once keeps an operand used by several products small in registers."""
    if PREC == "bf16":
        y = x.to(tl.bfloat16)
    elif PREC == "bf16emu":
        y = _round_bf16(x.to(tl.float32))
    else:
        y = x
    return y


@triton.jit
def _store_cast(ptr, x, PREC: tl.constexpr, mask=None):
    """Stores x converted to the buffer's dtype (bf16 intermediates on the bf16 path, fp32 otherwise);
    "bf16emu" rounds to nearest first (the interpreter's conversion truncates)."""
    if PREC == "bf16emu":
        x = _round_bf16(x.to(tl.float32))
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gdn_decay(G, STRICT: tl.constexpr, BT: tl.constexpr):
    """E_ij = exp(G_i - G_j) on j < i (STRICT) or j <= i, 0 elsewhere; never exponentiates a positive number."""
    o = tl.arange(0, BT)
    if STRICT:
        msk = o[:, None] > o[None, :]
    else:
        msk = o[:, None] >= o[None, :]
    return tl.where(msk, tl.exp(tl.where(msk, G[:, None] - G[None, :], 0.)), 0.)


@triton.jit
def _causal(x, BT: tl.constexpr):
    """x [BT, BT] with its entries j > i set to zero: KDA's P and M are written only up to their diagonal blocks
    (the blocks right of them hold whatever the buffer held: a select, not a product, so NaN there is harmless)."""
    o = tl.arange(0, BT)
    return tl.where(o[:, None] >= o[None, :], x, 0.)


@triton.jit
def _chunk_rows(T, H, BT: tl.constexpr):
    """Program (chunk, batch*head) of a [NT, B*H] grid -> (i_b, i_h, i_bh (int64), rows [BT], rows < T)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    return i_bh // H, i_bh % H, i_bh, rows, rows < T
