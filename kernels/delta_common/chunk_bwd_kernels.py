"""Backward Triton kernels of the chunked gated delta rule (GDN: PER_CHANNEL=False, KDA: PER_CHANNEL=True).
Math, kernel plan and launch: chunk.py. The gradients of the padded intermediates [B, H, Tp, ...] are fp32
accumulators (dV', dHs in bf16 on the bf16 path); dq, dk, dG are written by _bwd_dqk and added to by _bwd_wy
and (KDA) _kda_intra_bwd."""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import _causal, _chunk_rows, _dot, _gdn_decay, _round_bf16, _store_cast, _to_op


@triton.jit
def _dv_local_kernel(q, k, Gc, P, do, dVl, scale, T, Tp, H, NG, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """dV'_local = scale * sum over the group's query heads of P^T dO (KDA: P from the forward's sub-chunk kernels;
    GDN forms it from q, k and G)."""
    i_v, i_t = tl.program_id(0), tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    o = tl.arange(0, BT)
    rows = i_t * BT + o
    rmask = rows < T
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    if not PER_CHANNEL:
        G = tl.load(Gc + i_bh * Tp + rows)
        k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        dec = _gdn_decay(G, False, BT)
    for iq in range(NG):
        i_hq = i_h * NG + iq
        if PER_CHANNEL:
            p = _causal(tl.load(P + ((i_b * Hq + i_hq) * Tp + rows[:, None]) * BT + o[None, :]), BT)
        else:
            q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
            p = _dot(q_c, tl.trans(k_c), PREC) * dec
        do_c = tl.load(do + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        acc += _dot(tl.trans(p), do_c, PREC)
    tl.store(dVl + (i_bh * Tp + rows[:, None]) * V + cv[None, :], scale * acc)


@triton.jit
def _state_bwd_kernel(q, QG, k, Kd, Gc, W, dVl, do, dHs, dVp, dhT, dh0, scale, T, Tp, NT, H, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NG: tl.constexpr,
                      PER_CHANNEL: tl.constexpr, HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """Reverse pass over chunks: dHs[c] = gradient dS' of the state leaving chunk c,
    dV' = dV'_local + (k exp(G_last - G)) dS', dS <- exp(G_last) dS' + scale (q exp(G))^T dO - W^T dV'.
    The loop exponentiates no [BT, K] tile: KDA reads both decayed products precomputed in parallel kernels
    (Kd from _solve_wy, QG = scale q exp(G) from _kda_diag); GDN, whose decays are per row, scales the rows of
    the [BT, BV] tiles instead (k dS' and dO), so that k and q go to the products as loaded. NG is a constexpr
    and the query-head loop unrolled: triton software-pipelines only innermost loops, so with grouped query
    heads a runtime loop would leave every load of the chunk loop synchronous."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    o = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    if HAS_DHT:
        dh = tl.load(dhT + (i_bh * K + ck[:, None]) * V + cv[None, :]).to(tl.float32)
    else:
        dh = tl.zeros([K, BV], dtype=tl.float32)
    # dV'_local and KDA's G_last are prefetched one chunk ahead by hand: triton pipelines neither (dV'_local
    # becomes the accumulator of the first product), and both are needed early in the chunk's dependency chain
    dvl_next = tl.load(dVl + (i_bh * Tp + (NT - 1) * BT + o[:, None]) * V + cv[None, :])
    if PER_CHANNEL:
        gl_next = tl.load(Gc + (i_bh * Tp + NT * BT - 1) * K + ck)
    for it in range(NT):
        i_t = NT - 1 - it
        rows = i_t * BT + o
        rmask = rows < T
        prev = tl.maximum(i_t - 1, 0)   # the chunk of the next step (chunk 0 reloads its own)
        dvl = dvl_next
        dvl_next = tl.load(dVl + (i_bh * Tp + prev * BT + o[:, None]) * V + cv[None, :])
        _store_cast(dHs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :], dh, PREC)
        if PER_CHANNEL:
            decay_last = tl.exp(gl_next)[:, None]
            gl_next = tl.load(Gc + (i_bh * Tp + prev * BT + BT - 1) * K + ck)
        else:
            G = tl.load(Gc + i_bh * Tp + rows)
            gl = tl.load(Gc + i_bh * Tp + i_t * BT + BT - 1)
            decay_last = tl.exp(gl)
        # the query heads' products (independent of dS') go onto the decayed state ahead of dS'-dependent ones
        dh_in = dh * decay_last
        for iq in tl.static_range(NG):
            i_hq = i_h * NG + iq
            do_c = tl.load(do + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :], mask=rmask[:, None], other=0.)
            if PER_CHANNEL:
                qg = tl.load(QG + ((i_b * Hq + i_hq) * Tp + rows[:, None]) * K + ck[None, :])
                dh_in += _dot(tl.trans(qg), do_c, PREC)
            else:
                q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None], other=0.)
                dh_in += _dot(tl.trans(q_c), do_c.to(tl.float32) * (scale * tl.exp(G))[:, None], PREC)
        if PER_CHANNEL:
            kd = tl.load(Kd + (i_bh * Tp + rows[:, None]) * K + ck[None, :])   # k exp(G_last - G), from _solve_wy
            dvp = dvl + _dot(kd, dh, PREC)
        else:
            k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.)
            dvp = dvl + tl.exp(gl - G)[:, None] * _dot(k_c, dh, PREC)
        _store_cast(dVp + (i_bh * Tp + rows[:, None]) * V + cv[None, :], dvp, PREC)
        w = tl.load(W + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        dh = dh_in - _dot(tl.trans(w), dvp, PREC)
    tl.store(dh0 + (i_bh * K + ck[:, None]) * V + cv[None, :], dh)


@triton.jit
def _dqk_query_products(do_b, hs_b, vp_b, off_do, off_kv, off_tv, rmask, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """One query head's pass over V: dO S^T [BT, K] and dO V'^T [BT, BT] (unscaled). *_b: the chunk's tiles at
    value column 0, off_*: the offsets of a [., BV] value block in them."""
    dqs = tl.zeros([BT, K], dtype=tl.float32)
    dp = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, V, BV):
        hb = tl.load(hs_b + i_v + off_kv)
        vp = tl.load(vp_b + i_v + off_tv)
        do_c = tl.load(do_b + i_v + off_do, mask=rmask, other=0.)
        dqs += _dot(do_c, tl.trans(hb), PREC)
        dp += _dot(do_c, tl.trans(vp), PREC)
    return dqs, dp


@triton.jit
def _dqk_query_grads(q_b, dq_b, dp_b, off_q, dqs, dp, k_c, eg, dec, dk_acc, dg_acc, scale, rmask,
                     BT: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """One query head's share of dq, dk, dG from its dO S^T and dO V'^T (see _bwd_dqk_kernel); stores dq (and
    KDA's dP). Returns the dk and dG accumulators with its terms added (dG per channel for KDA; for GDN only the
    q dq part of the per-row dG, the k dk part is taken from the final dk)."""
    o = tl.arange(0, BT)
    dp = tl.where(o[:, None] >= o[None, :], scale * dp, 0.)
    dqs = scale * dqs * eg
    if PER_CHANNEL:
        tl.store(dp_b + o[:, None] * BT + o[None, :], dp)
        tl.store(dq_b + off_q, dqs, mask=rmask)
        dg_acc += tl.load(q_b + off_q, mask=rmask, other=0.).to(tl.float32) * dqs
    else:
        dpg = dp * dec
        dq_c = dqs + _dot(dpg, k_c, PREC)
        tl.store(dq_b + off_q, dq_c, mask=rmask)
        q_c = tl.load(q_b + off_q, mask=rmask, other=0.)
        dg_acc += tl.sum(q_c.to(tl.float32) * dq_c, 1)
        dk_acc += _dot(tl.trans(dpg), q_c, PREC)
    return dk_acc, dg_acc


@triton.jit
def _bwd_dqk_kernel(q, k, Gc, Hs, dHs, Vp, dVp, do, dq, dk, dW, dG, dP, scale, T, Tp, NT, H, NG,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, GROUPED: tl.constexpr, PREC: tl.constexpr):
    """Per chunk, from the state S entering it (Hs), the gradient dS' of the state leaving it (dHs), V' and dV':
        dW = -dV' S^T
        state update S' = exp(G_last) S + (k exp(G_last - G))^T V':  dk = (V' dS'^T) exp(G_last - G),
            d exp(G_last) = sum_v S dS'
        per query head: dP = scale dO V'^T (causal; stored for KDA, whose _kda_intra_bwd takes it through the
            per-channel decays), dq = scale (dO S^T) exp(G); GDN also dq += (dP E) k, dk += (dP E)^T q
        dG: the G-derivatives of the above (per channel for KDA, per row for GDN)
    One program per (chunk, kv head) over the whole key dimension, V in blocks of BV: the [BT, K] results are
    accumulated in registers and written once, and dO V'^T is formed once per query head (not once per key
    block). The first query head's products share the pass over V of the kv head's, so with one query head per
    kv head every input tile is loaded once; further query heads (grouped queries) take one more pass each.
    Addresses are a scalar base per tile plus i32 offsets shared across the passes: hoisted 64-bit pointer
    tensors of every tile would take ~100 registers per thread."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    o = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = tl.arange(0, BV)
    rmask = (i_t * BT + o < T)[:, None]
    t0 = i_t * BT
    row_b = i_bh * Tp + t0                     # first row of the chunk in the padded [B, H, Tp, ...] buffers
    hs_b = Hs + (i_bh * NT + i_t) * K * V
    dhs_b = dHs + (i_bh * NT + i_t) * K * V
    vp_b = Vp + row_b * V
    dvp_b = dVp + row_b * V
    do_b = do + ((i_b * T + t0) * Hq + i_h * NG) * V
    q_b = q + ((i_b * T + t0) * Hq + i_h * NG) * K
    dq_b = dq + ((i_b * T + t0) * Hq + i_h * NG) * K
    dp_b = dP + ((i_b * Hq + i_h * NG) * Tp + t0) * BT
    off_kv = ck[:, None] * V + cv[None, :]
    off_tv = o[:, None] * V + cv[None, :]
    off_do = o[:, None] * (Hq * V) + cv[None, :]
    off_q = o[:, None] * (Hq * K) + ck[None, :]
    off_tk = o[:, None] * K + ck[None, :]
    dw = tl.zeros([BT, K], dtype=tl.float32)
    dkd = tl.zeros([BT, K], dtype=tl.float32)
    dd = tl.zeros([K], dtype=tl.float32)
    dqs = tl.zeros([BT, K], dtype=tl.float32)
    dp = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, V, BV):
        hb = tl.load(hs_b + i_v + off_kv)
        dhb = tl.load(dhs_b + i_v + off_kv)
        vp = tl.load(vp_b + i_v + off_tv)
        dvp = tl.load(dvp_b + i_v + off_tv)
        do_c = tl.load(do_b + i_v + off_do, mask=rmask, other=0.)
        dw += _dot(dvp, tl.trans(hb), PREC)
        dkd += _dot(vp, tl.trans(dhb), PREC)
        dd += tl.sum(hb.to(tl.float32) * dhb.to(tl.float32), 1)
        dqs += _dot(do_c, tl.trans(hb), PREC)
        dp += _dot(do_c, tl.trans(vp), PREC)
    tl.store(dW + row_b * K + off_tk, -dw)
    # the first query head's terms and the state part of dk, in an order that keeps few [BT, K] tiles live (each
    # tile loaded after the stores before it, which it cannot be moved above)
    off_k = ((i_b * T + t0) * H + i_h) * K + o[:, None] * (H * K) + ck[None, :]
    if PER_CHANNEL:
        Gk = tl.load(Gc + row_b * K + off_tk)
        eg = tl.exp(Gk)
        dec = eg    # unused, like k_c in _dqk_query_grads: the decayed dP terms of KDA are _kda_intra_bwd's
        dk_acc, dg_acc = _dqk_query_grads(q_b, dq_b, dp_b, off_q, dqs, dp, eg, eg, dec, dkd,
                                          tl.zeros([BT, K], dtype=tl.float32), scale, rmask, BT, PER_CHANNEL, PREC)
        glk = tl.load(Gc + (row_b + BT - 1) * K + ck)
        dk_acc = dk_acc * tl.exp(glk[None, :] - Gk)
        k_c = tl.load(k + off_k, mask=rmask, other=0.).to(tl.float32)
        kdk = k_c * dk_acc
        dg_acc += tl.where(o[:, None] == BT - 1, (tl.sum(kdk, 0) + tl.exp(glk) * dd)[None, :], 0.) - kdk
        tl.store(dk + off_k, dk_acc, mask=rmask)     # final: KDA's query-head terms of dk are _kda_intra_bwd's
    else:
        G = tl.load(Gc + row_b + o)
        gl = tl.load(Gc + row_b + BT - 1)
        dk_acc = dkd * tl.exp(gl - G)[:, None]
        k_c = tl.load(k + off_k, mask=rmask, other=0.)
        d_last = tl.sum(tl.sum(k_c.to(tl.float32) * dk_acc, 1), 0) + tl.exp(gl) * tl.sum(dd, 0)
        eg = tl.exp(G)[:, None]
        dec = _gdn_decay(G, False, BT)
        dk_acc, dg_acc = _dqk_query_grads(q_b, dq_b, dp_b, off_q, dqs, dp, k_c, eg, dec, dk_acc,
                                          tl.where(o == BT - 1, d_last, 0.), scale, rmask, BT, PER_CHANNEL, PREC)
    if GROUPED:
        # further query heads (NG > 1). GDN's go into accumulators of their own, added after the loop: a loop that
        # took the first head's dk, dG would put it in the forward slice of the first head's tl.dot, which triton's
        # Hopper layout choice reads as a chained dot (as in attention) and answers with a [num_warps, 1] warp
        # tiling (the 64-row tile duplicated in both warp groups: register spills). KDA's dk is final already.
        dp_head = Tp.to(tl.int64) * BT          # dP's stride between query heads
        dk_more = tl.zeros_like(dk_acc)
        if PER_CHANNEL:
            dg_more = dg_acc
        else:
            dg_more = tl.zeros_like(dg_acc)
        for iq in range(1, NG):
            dqs, dp = _dqk_query_products(do_b + iq * V, hs_b, vp_b, off_do, off_kv, off_tv, rmask, K, V, BT, BV,
                                          PREC)
            dk_more, dg_more = _dqk_query_grads(q_b + iq * K, dq_b + iq * K, dp_b + iq * dp_head, off_q, dqs, dp,
                                                k_c, eg, dec, dk_more, dg_more, scale, rmask, BT, PER_CHANNEL, PREC)
        if PER_CHANNEL:
            dg_acc = dg_more
        else:
            dk_acc += dk_more
            dg_acc += dg_more
    if PER_CHANNEL:
        tl.store(dG + row_b * K + off_tk, dg_acc)
    else:
        tl.store(dk + off_k, dk_acc, mask=rmask)
        tl.store(dG + row_b + o, dg_acc - tl.sum(k_c.to(tl.float32) * dk_acc, 1))


@triton.jit
def _wy_key_block(k, dW, Gc, i_b, i_h, i_bh, T, Tp, H, rows, rmask, ckb, K: tl.constexpr,
                  PER_CHANNEL: tl.constexpr):
    """One key block of _bwd_wy's two passes: k (fp32), dW and exp(G) (per channel for KDA, per row for GDN)."""
    k_b = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ckb[None, :], mask=rmask[:, None],
                  other=0.).to(tl.float32)
    dw_b = tl.load(dW + (i_bh * Tp + rows[:, None]) * K + ckb[None, :])
    if PER_CHANNEL:
        eg_b = tl.exp(tl.load(Gc + (i_bh * Tp + rows[:, None]) * K + ckb[None, :]))
    else:
        eg_b = tl.exp(tl.load(Gc + i_bh * Tp + rows))[:, None]
    return k_b, dw_b, eg_b


@triton.jit
def _bwd_wy_kernel(k, v, beta, Gc, M, Tinv, dW, dVp, dk, dv, dbeta, dG, dM, T, Tp, H,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                   PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """Backward of W = T (beta exp(G) k), U = T (beta v), T = (I + diag(beta) M)^-1. K in blocks of BK, in two
    passes (dT = dW kg^T first; then the per-channel dk, dG once dA is known), to keep the register tiles small."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o = tl.arange(0, BT)
    rows = i_t * BT + o
    rmask = rows < T
    b_c = tl.load(beta + (i_b * T + rows) * H + i_h, mask=rmask, other=0.).to(tl.float32)
    tm = tl.load(Tinv + (i_bh * Tp + rows[:, None]) * BT + o[None, :])
    # T^T loaded transposed rather than tl.trans(tm): with triton 3.6 on the H200 at 4 warps and bf16 products, the
    # register transpose as the first operand of pass 2's T^T dW gave a wrong product (KDA, K = 64, key blocks of 16
    # or 32: relative error ~1, or NaN); see BENCHMARKS.md, History, 2026-12-02 — KDA's bf16 backward mended
    tmt = _to_op(tl.load(Tinv + (i_bh * Tp + rows[None, :]) * BT + o[:, None]), PREC)
    if not PER_CHANNEL:
        G = tl.load(Gc + i_bh * Tp + rows)
    # pass 1: dT = dW (beta exp(G) k)^T (and GDN's k k^T)
    dt = tl.zeros([BT, BT], dtype=tl.float32)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, K, BK):
        ckb = i_k + tl.arange(0, BK)
        k_b, dw_b, eg_b = _wy_key_block(k, dW, Gc, i_b, i_h, i_bh, T, Tp, H, rows, rmask, ckb, K, PER_CHANNEL)
        dt += _dot(dw_b, tl.trans(b_c[:, None] * eg_b * k_b), PREC)
        if not PER_CHANNEL:
            kk += _dot(k_b, tl.trans(k_b), PREC)
    db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, V, BV):
        cv = i_v + tl.arange(0, BV)
        du = tl.load(dVp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        v_c = tl.load(v + ((i_b * T + rows[:, None]) * H + i_h) * V + cv[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        dt += _dot(du, tl.trans(b_c[:, None] * v_c), PREC)
        dbv = _dot(tmt, du, PREC)
        db += tl.sum(v_c * dbv, 1)
        dv_c = b_c[:, None] * dbv
        if PREC == "bf16emu":
            dv_c = _round_bf16(dv_c)
        tl.store(dv + ((i_b * T + rows[:, None]) * H + i_h) * V + cv[None, :], dv_c.to(dv.dtype.element_ty),
                 mask=rmask[:, None])
    strict = o[:, None] > o[None, :]
    da = _dot(_dot(tmt, dt, PREC), tl.trans(tm), PREC)
    da = tl.where(strict, -da, 0.)
    if PER_CHANNEL:
        m = tl.where(strict, tl.load(M + (i_bh * Tp + rows[:, None]) * BT + o[None, :]), 0.)   # j > i: unwritten
    else:
        dec = _gdn_decay(G, True, BT)
        m = kk * dec
    db += tl.sum(da * m, 1)
    dm = b_c[:, None] * da
    if PER_CHANNEL:
        tl.store(dM + (i_bh * Tp + rows[:, None]) * BT + o[None, :], dm)
    else:
        dmg = dm * dec
        dg_row = tl.zeros([BT], dtype=tl.float32)
    # pass 2: d(beta exp(G) k) = T^T dW -> dk, dbeta, dG; GDN adds the k k^T terms through dA
    for i_k in range(0, K, BK):
        ckb = i_k + tl.arange(0, BK)
        k_b, dw_b, eg_b = _wy_key_block(k, dW, Gc, i_b, i_h, i_bh, T, Tp, H, rows, rmask, ckb, K, PER_CHANNEL)
        dkg = _dot(tmt, dw_b, PREC)
        db += tl.sum(eg_b * k_b * dkg, 1)
        dk_b = b_c[:, None] * eg_b * dkg
        if PER_CHANNEL:
            dg_ptr = dG + (i_bh * Tp + rows[:, None]) * K + ckb[None, :]
            tl.store(dg_ptr, tl.load(dg_ptr) + k_b * dk_b)
        else:
            dkr = _dot(dmg, k_b, PREC)
            dkc = _dot(tl.trans(dmg), k_b, PREC)
            dg_row += tl.sum(k_b * (dk_b + dkr - dkc), 1)
            dk_b += dkr + dkc
        dk_ptr = dk + ((i_b * T + rows[:, None]) * H + i_h) * K + ckb[None, :]
        tl.store(dk_ptr, tl.load(dk_ptr, mask=rmask[:, None], other=0.) + dk_b, mask=rmask[:, None])
    if not PER_CHANNEL:
        dgp = tl.load(dG + i_bh * Tp + rows)
        tl.store(dG + i_bh * Tp + rows, dgp + dg_row)
    tl.store(dbeta + (i_b * T + rows) * H + i_h, db, mask=rmask)


@triton.jit
def _chunk_block(x, row0, col0, BT: tl.constexpr, BC: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The BC x BC block of a chunk's [BT, BT] matrix x (dP or dM; rows from padded row row0, columns from chunk
    column col0), or its transpose."""
    oc = tl.arange(0, BC)
    if TRANSPOSED:
        blk = tl.load(x + (row0 + oc[None, :]) * BT + col0 + oc[:, None])
    else:
        blk = tl.load(x + (row0 + oc[:, None]) * BT + col0 + oc[None, :])
    return blk


@triton.jit
def _kda_bwd_rows(pb, mb, row_i, col_j, kf_j, WITH_M: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                  PREC: tl.constexpr):
    """Row role of sub-chunk rows i (row row_i on of the dP, dM bases pb, mb) against the columns j of an earlier
    sub-chunk (chunk column col_j on), kf_j = k_j exp(G_m - G_j) decayed to a reference row m between them:
    (dP kf_j, dM kf_j), the sums of dq and dk before their decay exp(G_i - G_m); dM's is 0 unless WITH_M."""
    dq = _dot(_chunk_block(pb, row_i, col_j, BT, BC, False), kf_j, PREC)
    if WITH_M:
        dkr = _dot(_chunk_block(mb, row_i, col_j, BT, BC, False), kf_j, PREC)
    else:
        dkr = tl.zeros_like(dq)
    return dq, dkr


@triton.jit
def _kda_bwd_cols(pb, mb, row_i, col_j, kf_i, qf_i, WITH_M: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                  PREC: tl.constexpr):
    """Column role of sub-chunk columns j (chunk column col_j on) against the rows i of a later sub-chunk (row row_i
    on of pb, mb), kf_i, qf_i = k_i, q_i exp(G_i - G_m): dP^T qf_i + dM^T kf_i (dM's only WITH_M), the sum of dk
    before its decay exp(G_m - G_j)."""
    dkc = _dot(_chunk_block(pb, row_i, col_j, BT, BC, True), qf_i, PREC)
    if WITH_M:
        dkc += _dot(_chunk_block(mb, row_i, col_j, BT, BC, True), kf_i, PREC)
    return dkc


@triton.jit
def _kda_bwd_level(Gs, ck, G, k, q, dp_d, dp_t, dm_d, dm_t, dq, dkr, dkc, K: tl.constexpr, WITH_M: tl.constexpr,
                   S: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Level S of _kda_bwd_diag: the pairs (i, j) of a sub-chunk's diagonal block (dP, dM and their transposes
    dp_d, dp_t, dm_d, dm_t) with i in the second and j in the first half of the same S-row group, through the
    group's middle row m; returns dq, dkr, dkc with their sums added."""
    HS: tl.constexpr = S // 2
    oc = tl.arange(0, BC)
    second = (oc % S) >= HS
    same = (oc[:, None] // S) == (oc[None, :] // S)
    pairs = same & second[:, None] & (oc % S < HS)[None, :]
    pairs_t = same & (oc % S < HS)[:, None] & second[None, :]
    G_m = tl.load(Gs + ((oc // S) * S + HS)[:, None] * K + ck[None, :])
    f = tl.exp(tl.where(second[:, None], G - G_m, G_m - G))
    kf = k * f
    dq += f * _dot(tl.where(pairs, dp_d, 0.), kf, PREC)
    c = _dot(tl.where(pairs_t, dp_t, 0.), q * f, PREC)
    if WITH_M:
        dkr += f * _dot(tl.where(pairs, dm_d, 0.), kf, PREC)
        c += _dot(tl.where(pairs_t, dm_t, 0.), kf, PREC)
    dkc += f * c
    return dq, dkr, dkc


@triton.jit
def _kda_bwd_diag(Gs, pb, mb, row0, col0, ck, G, k, q, K: tl.constexpr, WITH_M: tl.constexpr, BT: tl.constexpr,
                  BC: tl.constexpr, PREC: tl.constexpr):
    """The diagonal BC x BC block of a sub-chunk (rows row0 on of the dP, dM bases pb, mb, chunk column col0 on;
    Gs: its first row of G; G, k, q: its [BC, BK] tiles): (dq, dkr, dkc), the row-role sums of dq and dk and the
    column-role sum of dk over its pairs j <= i. The pairs j < i are split by the binary hierarchy of the block:
    at level S (16, 8, 4, 2) the pairs with i in the second and j in the first half of the same S-row group, all
    decayed through the group's middle row m, exp(G_i - G_m) exp(G_m - G_j) (both exponents <= 0): one [BC, BK]
    exp tile and masked [BC, BC] products per level (_kda_bwd_level), in place of BC exps per entry. The pairs
    i = j have no decay; their dG terms (q dP_ii k - k dP_ii q) cancel."""
    tl.static_assert(BC == 16)
    oc = tl.arange(0, BC)
    dp_d = _chunk_block(pb, row0, col0, BT, BC, False)
    dp_t = _chunk_block(pb, row0, col0, BT, BC, True)
    p_ii = tl.load(pb + (row0 + oc) * BT + col0 + oc)[:, None]
    dq = p_ii * k
    dkc = p_ii * q
    if WITH_M:
        dm_d = _chunk_block(mb, row0, col0, BT, BC, False)
        dm_t = _chunk_block(mb, row0, col0, BT, BC, True)
        dkr = tl.zeros_like(dq)
    else:
        dm_d = dp_d     # placeholders, unused without M
        dm_t = dp_t
        dkr = dq
    dq, dkr, dkc = _kda_bwd_level(Gs, ck, G, k, q, dp_d, dp_t, dm_d, dm_t, dq, dkr, dkc, K, WITH_M, BC, BC, PREC)
    dq, dkr, dkc = _kda_bwd_level(Gs, ck, G, k, q, dp_d, dp_t, dm_d, dm_t, dq, dkr, dkc, K, WITH_M, BC // 2, BC,
                                  PREC)
    dq, dkr, dkc = _kda_bwd_level(Gs, ck, G, k, q, dp_d, dp_t, dm_d, dm_t, dq, dkr, dkc, K, WITH_M, BC // 4, BC,
                                  PREC)
    dq, dkr, dkc = _kda_bwd_level(Gs, ck, G, k, q, dp_d, dp_t, dm_d, dm_t, dq, dkr, dkc, K, WITH_M, BC // 8, BC,
                                  PREC)
    if not WITH_M:
        dkr = tl.zeros_like(dq)
    return dq, dkr, dkc


@triton.jit
def _kda_bwd_add(dq_ptr, dk_ptr, dg_ptr, imask, k, q, dq_add, dkr, dkc):
    """dq += dq_add, dk += dkr + dkc, dG += q dq_add + k (dkr - dkc) on one sub-chunk's [BC, BK] block."""
    tl.store(dq_ptr, tl.load(dq_ptr, mask=imask, other=0.) + dq_add, mask=imask)
    tl.store(dk_ptr, tl.load(dk_ptr, mask=imask, other=0.) + dkr + dkc, mask=imask)
    tl.store(dg_ptr, tl.load(dg_ptr) + q * dq_add + k * (dkr - dkc))


@triton.jit
def _kda_bwd_tile(x, row, stride, ck, T, BC: tl.constexpr):
    """Rows [row, row + BC) of an input [B, T, ., K] (base x at the head, row stride ``stride``) as float32, zeros
    past T."""
    r = row + tl.arange(0, BC)
    return tl.load(x + r[:, None] * stride + ck[None, :], mask=(r < T)[:, None], other=0.).to(tl.float32)


@triton.jit
def _kda_intra_bwd_rows(q, k, Gc, dP, dM, dq, dk, dG, i_b, i_h, i_bh, iq, t0, I, ck, T, Tp, H, NG,
                        K: tl.constexpr, WITH_M: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                        PREC: tl.constexpr):
    """Sub-chunk I's rows of _kda_intra_bwd_kernel for one query head (P terms; M's too WITH_M), added into dq,
    dk and dG."""
    Hq = H * NG
    i_hq = i_h * NG + iq
    oc = tl.arange(0, BC)
    kb = k + (i_b * T * H + i_h) * K
    qb = q + (i_b * T * Hq + i_hq) * K
    pb = dP + (i_b * Hq + i_hq) * Tp * BT
    mb = dM + i_bh * Tp * BT
    Gs = Gc + (i_bh * Tp + t0) * K          # the chunk's first row of G
    KS = H * K
    QS = Hq * K
    r_i = t0 + I * BC
    G = tl.load(Gs + (I * BC + oc)[:, None] * K + ck[None, :])
    k_i = _kda_bwd_tile(kb, r_i, KS, ck, T, BC)
    q_i = _kda_bwd_tile(qb, r_i, QS, ck, T, BC)
    dq_i, dkr, dkc = _kda_bwd_diag(Gs + I * BC * K, pb, mb, r_i, I * BC, ck, G, k_i, q_i, K, WITH_M, BT, BC, PREC)
    # level 32: sub-chunk 2p + 1 against 2p through its first row m
    J = I ^ 1
    r_j = t0 + J * BC
    g_m = tl.load(Gs + (I | 1) * BC * K + ck)[None, :]
    G_j = tl.load(Gs + (J * BC + oc)[:, None] * K + ck[None, :])
    k_j = _kda_bwd_tile(kb, r_j, KS, ck, T, BC)
    if I % 2 == 1:
        f_i = tl.exp(G - g_m)
        a, b = _kda_bwd_rows(pb, mb, r_i, J * BC, k_j * tl.exp(g_m - G_j), WITH_M, BT, BC, PREC)
        dq_i += f_i * a
        dkr += f_i * b
    else:
        f_j = tl.exp(G_j - g_m)
        c = _kda_bwd_cols(pb, mb, r_j, I * BC, k_j * f_j, _kda_bwd_tile(qb, r_j, QS, ck, T, BC) * f_j, WITH_M, BT,
                          BC, PREC)
        dkc += tl.exp(g_m - G) * c
    # level 64: sub-chunks 2, 3 against 0, 1 through row 2 BC
    g_m = tl.load(Gs + 2 * BC * K + ck)[None, :]
    if I >= 2:
        G_j = tl.load(Gs + oc[:, None] * K + ck[None, :])
        a, b = _kda_bwd_rows(pb, mb, r_i, 0, _kda_bwd_tile(kb, t0, KS, ck, T, BC) * tl.exp(g_m - G_j), WITH_M, BT,
                             BC, PREC)
        G_j = tl.load(Gs + (BC + oc)[:, None] * K + ck[None, :])
        a2, b2 = _kda_bwd_rows(pb, mb, r_i, BC, _kda_bwd_tile(kb, t0 + BC, KS, ck, T, BC) * tl.exp(g_m - G_j),
                               WITH_M, BT, BC, PREC)
        f_i = tl.exp(G - g_m)
        dq_i += f_i * (a + a2)
        dkr += f_i * (b + b2)
    else:
        G_j = tl.load(Gs + (2 * BC + oc)[:, None] * K + ck[None, :])
        f_j = tl.exp(G_j - g_m)
        c = _kda_bwd_cols(pb, mb, t0 + 2 * BC, I * BC, _kda_bwd_tile(kb, t0 + 2 * BC, KS, ck, T, BC) * f_j,
                          _kda_bwd_tile(qb, t0 + 2 * BC, QS, ck, T, BC) * f_j, WITH_M, BT, BC, PREC)
        G_j = tl.load(Gs + (3 * BC + oc)[:, None] * K + ck[None, :])
        f_j = tl.exp(G_j - g_m)
        c += _kda_bwd_cols(pb, mb, t0 + 3 * BC, I * BC, _kda_bwd_tile(kb, t0 + 3 * BC, KS, ck, T, BC) * f_j,
                           _kda_bwd_tile(qb, t0 + 3 * BC, QS, ck, T, BC) * f_j, WITH_M, BT, BC, PREC)
        dkc += tl.exp(g_m - G) * c
    ri = r_i + oc
    imask = (ri < T)[:, None]
    _kda_bwd_add(dq + ((i_b * T + ri[:, None]) * Hq + i_hq) * K + ck[None, :],
                 dk + ((i_b * T + ri[:, None]) * H + i_h) * K + ck[None, :],
                 dG + (i_bh * Tp + ri[:, None]) * K + ck[None, :], imask, k_i, q_i, dq_i, dkr, dkc)


@triton.jit
def _kda_intra_bwd_kernel(q, k, Gc, dP, dM, dq, dk, dG, T, Tp, H, NG, iq, K: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr, BK: tl.constexpr, WITH_M: tl.constexpr, PREC: tl.constexpr):
    """KDA: gradients through the per-channel decayed products M (from dM) and P (from dP), in their row role (i)
    and their column role (j); adds them into dq, dk and dG (per channel c, E_ij = exp(G_ic - G_jc)):
        M: row role  dk_i = sum_{j<i} dM_ij k_j E_ij;   column role  dk_j = sum_{i>j} dM_ij k_i E_ij
        P: row role  dq_i = sum_{j<=i} dP_ij k_j E_ij;  column role  dk_j = sum_{i>=j} dP_ij q_i E_ij
        dG_i = k_i (M row role - M column role) + q_i (P row role) - k_i (P column role)
    One program per (sub-chunk I of BC rows, key block of BK channels, chunk): the channels are independent, and
    one program owns its [BC, BK] block of dq, dk and dG, so every entry gets a single read-modify-write (per
    query head). The pairs j < i follow the binary hierarchy of the chunk (BT = 4 BC): at each level the pairs
    with i in the second and j in the first half of a row group go through the group's middle row m,
    E_ij = exp(G_i - G_m) exp(G_m - G_j) (both exponents <= 0), as [BC, BC] x [BC, BK] tl.dots of dP, dM blocks
    with decayed k, q tiles: level 64 (rows of sub-chunks 2, 3 against columns of 0, 1, through row 2 BC), level
    32 (1 against 0, 3 against 2), then levels 16, 8, 4, 2 inside the sub-chunk (_kda_bwd_diag, masked blocks).
    A program takes 9 [BC, BK] exp tiles (its own rows at each of the 6 levels, the other sub-chunks' rows at
    the 2 outer ones), where a decay per pair takes BT / 2 exps per entry on average. One launch per query head
    iq of the group, one after the other (they add into the same dk, dG): the first (WITH_M) also takes the M
    terms, sharing its decays. (A loop over the heads inside the program doubled its registers, to spills.)"""
    tl.static_assert(BT == 4 * BC)
    NS: tl.constexpr = BT // BC
    i_k, I = tl.program_id(0) // NS, tl.program_id(0) % NS
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    ck = i_k * BK + tl.arange(0, BK)
    _kda_intra_bwd_rows(q, k, Gc, dP, dM, dq, dk, dG, i_b, i_h, i_bh, iq, t0, I, ck, T, Tp, H, NG, K, WITH_M, BT,
                        BC, PREC)


@triton.jit
def _rev_cumsum_kernel(dG, dg, T, Tp, H, K: tl.constexpr, BT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """dg_i = sum_{j >= i in the chunk} dG_j (G is the chunk-local cumulative sum of g)."""
    i_b, i_h, i_bh, rows, rmask = _chunk_rows(T, H, BT)
    if PER_CHANNEL:
        ck = tl.arange(0, K)
        x = tl.load(dG + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        r = tl.sum(x, 0)[None, :] - tl.cumsum(x, axis=0) + x
        tl.store(dg + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], r, mask=rmask[:, None])
    else:
        x = tl.load(dG + i_bh * Tp + rows)
        r = tl.sum(x, 0) - tl.cumsum(x, axis=0) + x
        tl.store(dg + (i_b * T + rows) * H + i_h, r, mask=rmask)
