"""Forward Triton kernels of the chunked gated delta rule (GDN: PER_CHANNEL=False, KDA: PER_CHANNEL=True).
Math, kernel plan and launch: chunk.py. Intermediates are laid out [B, H, Tp, ...] (Tp = NT * BT, padded rows
are exact no-ops); the inputs are [B, T, H, ...]."""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import _chunk_rows, _dot, _gdn_decay, _kda_diag_decay, _round_bf16, _store_cast, _to_op


@triton.jit
def _cumsum_kernel(g, Gc, T, Tp, H, K: tl.constexpr, BT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    i_b, i_h, i_bh, rows, rmask = _chunk_rows(T, H, BT)
    if PER_CHANNEL:
        ck = tl.arange(0, K)
        x = tl.load(g + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.)
        G = tl.cumsum(x.to(tl.float32), axis=0)
        tl.store(Gc + (i_bh * Tp + rows[:, None]) * K + ck[None, :], G)
    else:
        x = tl.load(g + (i_b * T + rows) * H + i_h, mask=rmask, other=0.)
        G = tl.cumsum(x.to(tl.float32), axis=0)
        tl.store(Gc + i_bh * Tp + rows, G)


@triton.jit
def _kda_offdiag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, I: tl.constexpr, W: tl.constexpr,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """KDA: the off-diagonal columns j < r0 = t0 + I * BC (earlier sub-chunks) of rows [r0, r0 + BC) of M and
    P: per key block one tl.dot of x_i exp(G_i - G_r0) and k_j exp(G_r0 - G_j) (both exponents <= 0). Only
    the chunk's first W >= I * BC rows j (a power of two) are loaded and exponentiated."""
    oc = tl.arange(0, BC)
    lw = tl.arange(0, W)
    r0 = t0 + I * BC
    ri = r0 + oc
    rj = t0 + lw
    imask = (ri < T)[:, None]
    jmask = (rj < T)[:, None]
    before = (lw < I * BC)[:, None]
    accm = tl.zeros([BC, W], dtype=tl.float32)
    accp = tl.zeros([BC, W], dtype=tl.float32)
    for kk in range(0, K, BK):
        ck = kk + tl.arange(0, BK)
        g_r = tl.load(Gb + r0 * K + ck)
        G_j = tl.load(Gb + rj[:, None] * K + ck[None, :])
        k_j = tl.load(kb + rj[:, None] * KS + ck[None, :], mask=jmask, other=0.).to(tl.float32)
        k_r = tl.trans(tl.where(before, k_j * tl.exp(tl.where(before, g_r[None, :] - G_j, 0.)), 0.))
        e_i = tl.exp(tl.load(Gb + ri[:, None] * K + ck[None, :]) - g_r[None, :])
        k_i = tl.load(kb + ri[:, None] * KS + ck[None, :], mask=imask, other=0.).to(tl.float32)
        q_i = tl.load(qb + ri[:, None] * QS + ck[None, :], mask=imask, other=0.).to(tl.float32)
        accm += _dot(k_i * e_i, k_r, PREC)
        accp += _dot(q_i * e_i, k_r, PREC)
    cols = (lw < I * BC)[None, :]
    first = (oc * 0 + iq == 0)[:, None]
    tl.store(mo + (I * BC + oc[:, None]) * BT + lw[None, :], accm, mask=cols & first)
    tl.store(po + (I * BC + oc[:, None]) * BT + lw[None, :], accp, mask=cols)


@triton.jit
def _kda_diag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, I: tl.constexpr, K: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, DBK: tl.constexpr):
    """KDA: the BC x BC diagonal block of sub-chunk I (rows and columns [r0, r0 + BC), r0 = t0 + I * BC) of M
    (j < i) and P (j <= i), and zeros right of it in rows [r0, r0 + BC). The block is taken as two halves a
    (its first HB = BC / 2 rows) and b: the pairs within a half elementwise, as [DBK, HB, HB] terms
    x_ic k_jc exp(-|G_ic - G_jc|) reduced over the channels c (which lie within each thread); the pairs
    (i in b, j in a) without per-pair exps, x_i exp(G_i - G_m) times k_j exp(G_m - G_j) about the first row m
    of b (both exponents <= 0): 9 / 16 of the exps of the whole block taken elementwise."""
    HB: tl.constexpr = BC // 2
    oh = tl.arange(0, HB)
    r0 = t0 + I * BC
    ra = r0 + oh
    rb = ra + HB
    amask = (ra < T)[None, :]
    bmask = (rb < T)[None, :]
    acc_aa_m = tl.zeros([HB, HB], dtype=tl.float32)
    acc_aa_p = tl.zeros([HB, HB], dtype=tl.float32)
    acc_bb_m = tl.zeros([HB, HB], dtype=tl.float32)
    acc_bb_p = tl.zeros([HB, HB], dtype=tl.float32)
    acc_ba_m = tl.zeros([HB, HB], dtype=tl.float32)
    acc_ba_p = tl.zeros([HB, HB], dtype=tl.float32)
    for kk in range(0, K, DBK):
        cd = (kk + tl.arange(0, DBK))[:, None]
        g_m = tl.load(Gb + (r0 + HB) * K + cd)
        # half a: rows (and columns) ra, channels first
        G_t = tl.load(Gb + ra[None, :] * K + cd)
        k_t = tl.load(kb + ra[None, :] * KS + cd, mask=amask, other=0.).to(tl.float32)
        q_t = tl.load(qb + ra[None, :] * QS + cd, mask=amask, other=0.).to(tl.float32)
        kx = k_t[:, None, :] * _kda_diag_decay(G_t, HB, True)     # k_jc exp(-|G_ic - G_jc|)
        acc_aa_m += tl.sum(k_t[:, :, None] * kx, 0)
        acc_aa_p += tl.sum(q_t[:, :, None] * kx, 0)
        k_m = k_t * tl.exp(g_m - G_t)                             # k_jc exp(G_mc - G_jc), j in a
        # half b
        G_t = tl.load(Gb + rb[None, :] * K + cd)
        k_t = tl.load(kb + rb[None, :] * KS + cd, mask=bmask, other=0.).to(tl.float32)
        q_t = tl.load(qb + rb[None, :] * QS + cd, mask=bmask, other=0.).to(tl.float32)
        kx = k_t[:, None, :] * _kda_diag_decay(G_t, HB, True)
        acc_bb_m += tl.sum(k_t[:, :, None] * kx, 0)
        acc_bb_p += tl.sum(q_t[:, :, None] * kx, 0)
        e_m = tl.exp(G_t - g_m)                                   # exp(G_ic - G_mc), i in b
        k_m = k_m[:, None, :]
        acc_ba_m += tl.sum((k_t * e_m)[:, :, None] * k_m, 0)
        acc_ba_p += tl.sum((q_t * e_m)[:, :, None] * k_m, 0)
    # within a half, the upper part (j > i, decays exp(G_j - G_i)) is not in M or P
    strict = oh[:, None] > oh[None, :]
    diag = oh[:, None] >= oh[None, :]
    ia = (I * BC + oh[:, None]) * BT
    ib = ia + HB * BT
    ja = (I * BC + oh)[None, :]
    jb = ja + HB
    first = (oh * 0 + iq == 0)[:, None]
    tl.store(mo + ia + ja, tl.where(strict, acc_aa_m, 0.), mask=first)
    tl.store(mo + ib + jb, tl.where(strict, acc_bb_m, 0.), mask=first)
    tl.store(mo + ib + ja, acc_ba_m, mask=first)
    tl.store(po + ia + ja, tl.where(diag, acc_aa_p, 0.))
    tl.store(po + ib + jb, tl.where(diag, acc_bb_p, 0.))
    tl.store(po + ib + ja, acc_ba_p)
    # zeros: rows a at columns >= r0 + HB, rows b at columns >= r0 + BC
    oc = tl.arange(0, BC)
    la = tl.arange(0, BT)
    upper = la[None, :] >= I * BC + HB + tl.where(oc >= HB, HB, 0)[:, None]
    zeros = tl.zeros([BC, BT], dtype=tl.float32)
    tl.store(mo + (I * BC + oc[:, None]) * BT + la[None, :], zeros, mask=upper & (oc * 0 + iq == 0)[:, None])
    tl.store(po + (I * BC + oc[:, None]) * BT + la[None, :], zeros, mask=upper)


@triton.jit
def _kda_intra_kernel(q, k, Gc, M, P, T, Tp, H, NG, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, DBK: tl.constexpr, PREC: tl.constexpr):
    """KDA: the chunk's rows of M (x = k, j < i) and of P for query head iq of the group (x = q, j <= i),
    M_ij / P_ij = sum_c x_ic k_jc exp(G_ic - G_jc), zeros above; M is stored by the iq = 0 program.
    One program per (chunk, query head of the group, kv head), over its NS = BT / BC = 4 sub-chunks in turn
    (unrolled; K in blocks inside each part, so that the tiles of one part are dead during the next):
      off-diagonal (sub-chunks 1..3): columns of the earlier sub-chunks, one tl.dot per key block
        against the sub-chunk's first row (_kda_offdiag_rows; only the first 16, 32, 64 columns of the chunk
        are exponentiated and multiplied, and sub-chunk 0 has nothing to do);
      diagonal (every sub-chunk): the BC x BC block, elementwise in two halves (_kda_diag_rows)."""
    tl.static_assert(BT == 4 * BC)
    i_t, iq = tl.program_id(0), tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    t0 = i_t * BT
    Gb = Gc + i_bh * Tp * K
    kb = k + (i_b * T * H + i_h) * K
    qb = q + (i_b * T * Hq + i_h * NG + iq) * K
    mo = M + (i_bh * Tp + t0) * BT
    po = P + ((i_b * Hq + i_h * NG + iq) * Tp + t0) * BT
    QS = Hq * K
    KS = H * K
    _kda_diag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 0, K, BT, BC, DBK)
    _kda_offdiag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 1, BC, K, BT, BC, BK, PREC)
    _kda_diag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 1, K, BT, BC, DBK)
    _kda_offdiag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 2, 2 * BC, K, BT, BC, BK, PREC)
    _kda_diag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 2, K, BT, BC, DBK)
    _kda_offdiag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 3, BT, K, BT, BC, BK, PREC)
    _kda_diag_rows(qb, kb, Gb, mo, po, iq, t0, T, QS, KS, 3, K, BT, BC, DBK)


@triton.jit
def _rows(x, i_b, i_h, T, H, r0, D: tl.constexpr, BR: tl.constexpr):
    """Rows [r0, r0 + BR) of an input [B, T, H, D] (zeros past T), as float32."""
    r = r0 + tl.arange(0, BR)
    c = tl.arange(0, D)
    return tl.load(x + ((i_b * T + r[:, None]) * H + i_h) * D + c[None, :], mask=(r < T)[:, None], other=0.).to(tl.float32)


@triton.jit
def _inv_unit_lower(a, BC: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular BC x BC block, by forward substitution."""
    o = tl.arange(0, BC)
    tm = tl.where(o[:, None] == o[None, :], 1., 0.)
    for i in range(1, BC):
        a_i = tl.sum(tl.where(o[:, None] == i, a, 0.), 0)
        t_i = tl.sum(a_i[:, None] * tm, 0)
        tm = tl.where(o[:, None] == i, tm - t_i[None, :], tm)
    return tm


@triton.jit
def _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, I: tl.constexpr, J: tl.constexpr, k_i, k_j, g_i, g_j,
             BT: tl.constexpr, BC: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """Sub-block (I, J) of A = diag(beta) M (strictly lower when I == J). GDN: from the row blocks k_i, k_j
    and decays g_i, g_j; KDA: loaded from M."""
    oc = tl.arange(0, BC)
    ri = t0 + I * BC + oc
    if PER_CHANNEL:
        m = tl.load(M + (i_bh * Tp + ri[:, None]) * BT + J * BC + oc[None, :])
    else:
        rj = t0 + J * BC + oc
        msk = ri[:, None] > rj[None, :]
        m = tl.where(msk, _dot(k_i, tl.trans(k_j), PREC)
                     * tl.exp(tl.where(msk, g_i[:, None] - g_j[None, :], 0.)), 0.)
    b_i = tl.load(beta + (i_b * T + ri) * H + i_h, mask=ri < T, other=0.).to(tl.float32)
    return b_i[:, None] * m


@triton.jit
def _g_rows(Gc, i_bh, Tp, r0, BC: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Scalar decays of rows [r0, r0 + BC) (GDN; a dummy for KDA)."""
    r = r0 + tl.arange(0, BC)
    if PER_CHANNEL:
        return tl.zeros([BC], dtype=tl.float32)
    else:
        return tl.load(Gc + i_bh * Tp + r)


@triton.jit
def _kg_cols(k, beta, Gc, i_b, i_h, i_bh, T, Tp, H, r0, ck, K: tl.constexpr, BC: tl.constexpr,
             PER_CHANNEL: tl.constexpr):
    """beta * exp(G) * k on rows [r0, r0 + BC), key channels ck."""
    r = r0 + tl.arange(0, BC)
    k_i = tl.load(k + ((i_b * T + r[:, None]) * H + i_h) * K + ck[None, :], mask=(r < T)[:, None],
                  other=0.).to(tl.float32)
    b_i = tl.load(beta + (i_b * T + r) * H + i_h, mask=r < T, other=0.).to(tl.float32)
    if PER_CHANNEL:
        eg = tl.exp(tl.load(Gc + (i_bh * Tp + r[:, None]) * K + ck[None, :]))
    else:
        eg = tl.exp(tl.load(Gc + i_bh * Tp + r))[:, None]
    return b_i[:, None] * eg * k_i


@triton.jit
def _bv_block(v, beta, i_b, i_h, T, H, r0, cv, V: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BC)
    v_i = tl.load(v + ((i_b * T + r[:, None]) * H + i_h) * V + cv[None, :], mask=(r < T)[:, None], other=0.).to(tl.float32)
    b_i = tl.load(beta + (i_b * T + r) * H + i_h, mask=r < T, other=0.).to(tl.float32)
    return b_i[:, None] * v_i


@triton.jit
def _store_blk(ptr, i_bh, Tp, t0, I: tl.constexpr, J: tl.constexpr, x, BT: tl.constexpr, BC: tl.constexpr):
    oc = tl.arange(0, BC)
    tl.store(ptr + (i_bh * Tp + t0 + I * BC + oc[:, None]) * BT + J * BC + oc[None, :], x)


@triton.jit
def _store_lower_product(ptr, block_stride, u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, x0, x1, x2, x3,
                         PREC: tl.constexpr):
    """Store T X for a block lower-triangular T (4 x 4 blocks u_IJ, J <= I) and X in 4 row blocks x_J; row block I
    goes to ``ptr + I * block_stride`` (W = T (beta exp(G) k) and U = T (beta v) share this)."""
    _store_cast(ptr, _dot(u00, x0, PREC), PREC)
    _store_cast(ptr + block_stride, _dot(u10, x0, PREC) + _dot(u11, x1, PREC), PREC)
    _store_cast(ptr + 2 * block_stride, _dot(u20, x0, PREC) + _dot(u21, x1, PREC) + _dot(u22, x2, PREC), PREC)
    _store_cast(ptr + 3 * block_stride, _dot(u30, x0, PREC) + _dot(u31, x1, PREC) + _dot(u32, x2, PREC)
                + _dot(u33, x3, PREC), PREC)


@triton.jit
def _solve_wy_kernel(k, v, beta, Gc, M, Tinv, W, U, Kd, T, Tp, H, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     STORE_T: tl.constexpr, PREC: tl.constexpr, PREC_HI: tl.constexpr, BKW: tl.constexpr):
    """T = (I + diag(beta) M)^-1 blockwise (BT = 4 BC: diagonal BC-blocks by forward substitution, then
    T_IJ = -T_II sum_{J <= L < I} A_IL T_LJ); W = T (beta exp(G) k); U = T (beta v)."""
    tl.static_assert(BT == 4 * BC)
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    k0 = _rows(k, i_b, i_h, T, H, t0, K, BC)
    k1 = _rows(k, i_b, i_h, T, H, t0 + BC, K, BC)
    k2 = _rows(k, i_b, i_h, T, H, t0 + 2 * BC, K, BC)
    k3 = _rows(k, i_b, i_h, T, H, t0 + 3 * BC, K, BC)
    g0 = _g_rows(Gc, i_bh, Tp, t0, BC, PER_CHANNEL)
    g1 = _g_rows(Gc, i_bh, Tp, t0 + BC, BC, PER_CHANNEL)
    g2 = _g_rows(Gc, i_bh, Tp, t0 + 2 * BC, BC, PER_CHANNEL)
    g3 = _g_rows(Gc, i_bh, Tp, t0 + 3 * BC, BC, PER_CHANNEL)
    a00 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 0, 0, k0, k0, g0, g0, BT, BC, PER_CHANNEL, PREC)
    a11 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 1, 1, k1, k1, g1, g1, BT, BC, PER_CHANNEL, PREC)
    a22 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 2, 2, k2, k2, g2, g2, BT, BC, PER_CHANNEL, PREC)
    a33 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 3, 3, k3, k3, g3, g3, BT, BC, PER_CHANNEL, PREC)
    a10 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 1, 0, k1, k0, g1, g0, BT, BC, PER_CHANNEL, PREC)
    a20 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 2, 0, k2, k0, g2, g0, BT, BC, PER_CHANNEL, PREC)
    a21 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 2, 1, k2, k1, g2, g1, BT, BC, PER_CHANNEL, PREC)
    a30 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 3, 0, k3, k0, g3, g0, BT, BC, PER_CHANNEL, PREC)
    a31 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 3, 1, k3, k1, g3, g1, BT, BC, PER_CHANNEL, PREC)
    a32 = _a_block(beta, M, i_b, i_h, i_bh, T, Tp, H, t0, 3, 2, k3, k2, g3, g2, BT, BC, PER_CHANNEL, PREC)
    t00 = _inv_unit_lower(a00, BC)
    t11 = _inv_unit_lower(a11, BC)
    t22 = _inv_unit_lower(a22, BC)
    t33 = _inv_unit_lower(a33, BC)
    # the block merges of T stay at the high precision (fp32 operands) even when the other products are bf16
    t10 = -_dot(t11, _dot(a10, t00, PREC_HI), PREC_HI)
    t21 = -_dot(t22, _dot(a21, t11, PREC_HI), PREC_HI)
    t32 = -_dot(t33, _dot(a32, t22, PREC_HI), PREC_HI)
    t20 = -_dot(t22, _dot(a20, t00, PREC_HI) + _dot(a21, t10, PREC_HI), PREC_HI)
    t31 = -_dot(t33, _dot(a31, t11, PREC_HI) + _dot(a32, t21, PREC_HI), PREC_HI)
    t30 = -_dot(t33, _dot(a30, t00, PREC_HI) + _dot(a31, t10, PREC_HI) + _dot(a32, t20, PREC_HI), PREC_HI)
    if STORE_T:
        z = tl.zeros([BC, BC], dtype=tl.float32)
        _store_blk(Tinv, i_bh, Tp, t0, 0, 0, t00, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 0, 1, z, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 0, 2, z, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 0, 3, z, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 1, 0, t10, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 1, 1, t11, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 1, 2, z, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 1, 3, z, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 2, 0, t20, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 2, 1, t21, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 2, 2, t22, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 2, 3, z, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 3, 0, t30, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 3, 1, t31, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 3, 2, t32, BT, BC)
        _store_blk(Tinv, i_bh, Tp, t0, 3, 3, t33, BT, BC)
    oc = tl.arange(0, BC)
    # the T blocks as product operands (bf16 on the bf16 path), cast once for W and U
    u00, u10, u11 = _to_op(t00, PREC), _to_op(t10, PREC), _to_op(t11, PREC)
    u20, u21, u22 = _to_op(t20, PREC), _to_op(t21, PREC), _to_op(t22, PREC)
    u30, u31, u32, u33 = _to_op(t30, PREC), _to_op(t31, PREC), _to_op(t32, PREC), _to_op(t33, PREC)
    # W = T (beta exp(G) k), K in blocks of BKW (k reloaded from L1/L2 rather than kept live across the solve)
    for i_k in range(0, K, BKW):
        ckb = i_k + tl.arange(0, BKW)
        kg0 = _to_op(_kg_cols(k, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0, ckb, K, BC, PER_CHANNEL), PREC)
        kg1 = _to_op(_kg_cols(k, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0 + BC, ckb, K, BC, PER_CHANNEL), PREC)
        kg2 = _to_op(_kg_cols(k, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0 + 2 * BC, ckb, K, BC, PER_CHANNEL), PREC)
        kg3 = _to_op(_kg_cols(k, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0 + 3 * BC, ckb, K, BC, PER_CHANNEL), PREC)
        _store_lower_product(W + (i_bh * Tp + t0 + oc[:, None]) * K + ckb[None, :], BC * K,
                             u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, kg0, kg1, kg2, kg3, PREC)
        # KDA: k exp(G_last - G), the keys as they enter the state at the end of the chunk (for the state passes)
        if PER_CHANNEL:
            gl = tl.load(Gc + (i_bh * Tp + t0 + BT - 1) * K + ckb)
            ra = t0 + tl.arange(0, BT)
            k_a = tl.load(k + ((i_b * T + ra[:, None]) * H + i_h) * K + ckb[None, :], mask=(ra < T)[:, None],
                          other=0.).to(tl.float32)
            G_a = tl.load(Gc + (i_bh * Tp + ra[:, None]) * K + ckb[None, :])
            _store_cast(Kd + (i_bh * Tp + ra[:, None]) * K + ckb[None, :], k_a * tl.exp(gl[None, :] - G_a), PREC)
    for i_v in range(0, V, BV):
        cv = i_v + tl.arange(0, BV)
        bv0 = _to_op(_bv_block(v, beta, i_b, i_h, T, H, t0, cv, V, BC), PREC)
        bv1 = _to_op(_bv_block(v, beta, i_b, i_h, T, H, t0 + BC, cv, V, BC), PREC)
        bv2 = _to_op(_bv_block(v, beta, i_b, i_h, T, H, t0 + 2 * BC, cv, V, BC), PREC)
        bv3 = _to_op(_bv_block(v, beta, i_b, i_h, T, H, t0 + 3 * BC, cv, V, BC), PREC)
        _store_lower_product(U + (i_bh * Tp + t0 + oc[:, None]) * V + cv[None, :], BC * V,
                             u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, bv0, bv1, bv2, bv3, PREC)


@triton.jit
def _state_fwd_kernel(k, Kd, Gc, W, U, Hs, Vp, h0, hT, T, Tp, NT, H, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_H0: tl.constexpr,
                      PREC: tl.constexpr):
    """Sequential pass over chunks for one (batch, kv head, V block): stores the state entering each
    chunk (Hs) and the pseudo-values V' = U - W S; writes the final state."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o = tl.arange(0, BT)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    if HAS_H0:
        s = tl.load(h0 + (i_bh * K + ck[:, None]) * V + cv[None, :]).to(tl.float32)
    else:
        s = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(NT):
        rows = i_t * BT + o
        rmask = rows < T
        _store_cast(Hs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :], s, PREC)
        w = tl.load(W + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        u = tl.load(U + (i_bh * Tp + rows[:, None]) * V + cv[None, :]).to(tl.float32)
        vp = u - _dot(w, s, PREC)
        _store_cast(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :], vp, PREC)
        last = i_t * BT + BT - 1
        if PER_CHANNEL:
            kd = tl.load(Kd + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
            gl = tl.load(Gc + (i_bh * Tp + last) * K + ck)
            s = s * tl.exp(gl)[:, None]
        else:
            k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
            G = tl.load(Gc + i_bh * Tp + rows)
            gl = tl.load(Gc + i_bh * Tp + last)
            kd = k_c * tl.exp(gl - G)[:, None]
            s = s * tl.exp(gl)
        s += _dot(tl.trans(kd), vp, PREC)
    tl.store(hT + (i_bh * K + ck[:, None]) * V + cv[None, :], s)


@triton.jit
def _output_kernel(q, k, Gc, P, Hs, Vp, o_ptr, scale, T, Tp, NT, H, NG, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """O = scale [ (q exp(G)) S + P V' ] for one (V block, chunk, batch * query head)."""
    i_v, i_t = tl.program_id(0), tl.program_id(1)
    i_bhq = tl.program_id(2).to(tl.int64)
    Hq = H * NG
    i_b, i_hq = i_bhq // Hq, i_bhq % Hq
    i_h = i_hq // NG
    i_bh = i_b * H + i_h
    o = tl.arange(0, BT)
    rows = i_t * BT + o
    rmask = rows < T
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
    s = tl.load(Hs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :])
    if PER_CHANNEL:
        G = tl.load(Gc + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        qe = q_c * tl.exp(G)
        p = tl.load(P + (i_bhq * Tp + rows[:, None]) * BT + o[None, :])
    else:
        G = tl.load(Gc + i_bh * Tp + rows)
        qe = q_c * tl.exp(G)[:, None]
        k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        p = _dot(q_c, tl.trans(k_c), PREC) * _gdn_decay(G, False, BT)
    vp = tl.load(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
    acc = scale * (_dot(qe, s, PREC) + _dot(p, vp, PREC))
    if PREC == "bf16emu":
        acc = _round_bf16(acc)
    tl.store(o_ptr + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
