"""Forward Triton kernels of the chunked gated delta rule (GDN: PER_CHANNEL=False, KDA: PER_CHANNEL=True).
Math, kernel plan and launch: chunk.py. Intermediates are laid out [B, H, Tp, ...] (Tp = NT * BT, padded rows
are exact no-ops); the inputs are [B, T, H, ...]."""
from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import _causal, _chunk_rows, _dot, _gdn_decay, _round_bf16, _store_cast, _to_op


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
def _kda_diag_kernel(q, k, Gc, M, P, QG, scale, T, Tp, H, NG, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     DR: tl.constexpr, BH: tl.constexpr, OUT_PREC: tl.constexpr):
    """KDA: row i of the diagonal BC x BC block of M (x = k, j < i) and of P for query head iq (x = q, j <= i),
    for BH kv heads: M_ij / P_ij = sum_c x_ic k_jc exp(G_ic - G_jc) for the j of i's group of DR rows (DR = BC,
    or BC / 2 with the pairs across the two halves left to _kda_intra) up to i (exponents <= 0), zeros right of
    i; M is stored by the iq = 0 program. Also row i of QG = scale q exp(G) [B, Hq, Tp, K] (G_i <= 0), the decayed
    queries of _output's and _state_bwd's products. P and QG are stored at OUT_PREC, the precision of _output's
    products (_store_cast: bf16 on the bf16 path, where _output would round P to bf16 anyway). One
    program per (padded row i, query head of the group, batch and block of BH kv heads): elementwise products over
    the whole key dimension and sums, exact in fp32 on every path, one exp per channel and pair; no tl.dot (16 x 16
    blocks cost more in layout conversions than in products)."""
    i, iq = tl.program_id(0), tl.program_id(1)
    i_bhb = tl.program_id(2)
    HB = tl.cdiv(H, BH)
    i_b = (i_bhb // HB).to(tl.int64)
    h = (i_bhb % HB) * BH + tl.arange(0, BH)
    hmask = (h < H)[:, None]
    Hq = H * NG
    s0 = (i // BC) * BC
    r0 = (i // DR) * DR
    ck = tl.arange(0, K)[None, :]
    oc = tl.arange(0, BC)[None, :]
    Gb = Gc + (i_b * H + h[:, None]) * Tp * K + ck
    kb = k + (i_b * T * H + h[:, None]) * K + ck
    inside = hmask & ((ck * 0 + i) < T)
    G_i = tl.load(Gb + i * K, mask=hmask, other=0.)
    x_q = tl.load(q + ((i_b * T + i) * Hq + h[:, None] * NG + iq) * K + ck, mask=inside, other=0.).to(tl.float32)
    x_k = tl.load(kb + i * H * K, mask=inside, other=0.).to(tl.float32)
    m_row = tl.zeros([BH, BC], dtype=tl.float32)
    p_row = tl.zeros([BH, BC], dtype=tl.float32)
    for j in range(r0, i + 1):
        k_j = tl.load(kb + j * H * K, mask=hmask & ((ck * 0 + j) < T), other=0.).to(tl.float32)
        kg = k_j * tl.exp(G_i - tl.load(Gb + j * K, mask=hmask, other=0.))
        at_j = oc == j - s0
        p_row = tl.where(at_j, tl.sum(x_q * kg, 1)[:, None], p_row)
        m_row = tl.where(at_j & (j < i), tl.sum(x_k * kg, 1)[:, None], m_row)
    mine = hmask & (oc >= r0 - s0)     # the pairs across the halves (DR < BC) are _kda_intra's
    first = (oc * 0 + iq) == 0
    tl.store(M + ((i_b * H + h[:, None]) * Tp + i) * BT + (s0 % BT) + oc, m_row, mask=mine & first)
    _store_cast(P + ((i_b * Hq + h[:, None] * NG + iq) * Tp + i) * BT + (s0 % BT) + oc, p_row, OUT_PREC, mask=mine)
    _store_cast(QG + ((i_b * Hq + h[:, None] * NG + iq) * Tp + i) * K + ck, scale * x_q * tl.exp(G_i), OUT_PREC,
                mask=hmask)


@triton.jit
def _kda_decayed_columns(kb, Gb, g_r, c0, T, ck, KS, K: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """KDA: k_j exp(G_r - G_j) for the BC rows j = c0 + [0, BC) of an earlier sub-chunk at channels ck (g_r: the
    reference row's G there, [1, BK]; exponents <= 0), transposed to [BK, BC]: a block product's right factor."""
    rj = c0 + tl.arange(0, BC)
    k_j = tl.load(kb + rj[:, None] * KS + ck[None, :], mask=(rj < T)[:, None], other=0.).to(tl.float32)
    return _to_op(tl.trans(k_j * tl.exp(g_r - tl.load(Gb + rj[:, None] * K + ck[None, :]))), PREC)


@triton.jit
def _kda_cross_half_pairs(G_i, k_i, q_i, Gb, r0, ck, K: tl.constexpr, BC: tl.constexpr, DR: tl.constexpr,
                          PREC: tl.constexpr):
    """KDA, one key block (channels ck) of the pairs of the diagonal block of rows r0 + [0, BC) (G_i, k_i, q_i: its
    [BC, BK] tiles) with j in its first DR rows and i in the rest, decayed through the middle row m = r0 + DR as
    exp(G_i - G_m) exp(G_m - G_j) (both exponents <= 0): M's and P's terms, [BC, BC] each, zero outside those
    pairs."""
    second_half = (tl.arange(0, BC) >= DR)[:, None]
    g_m = tl.load(Gb + (r0 + DR) * K + ck)[None, :]
    e_i = tl.where(second_half, tl.exp(tl.where(second_half, G_i - g_m, 0.)), 0.)
    col = _to_op(tl.trans(tl.where(second_half, 0., k_i * tl.exp(tl.where(second_half, 0., g_m - G_i)))), PREC)
    return _dot(_to_op(k_i * e_i, PREC), col, PREC), _dot(_to_op(q_i * e_i, PREC), col, PREC)


@triton.jit
def _kda_intra_kernel(q, k, Gc, M, P, T, Tp, H, NG, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, DR: tl.constexpr, PREC: tl.constexpr, OUT_PREC: tl.constexpr):
    """KDA: the BC rows of sub-chunk I of a chunk in M (x = k, j < i) and in P for query head iq of the group
    (x = q, j <= i) left of the diagonal block, M_ij / P_ij = sum_c x_ic k_jc exp(G_ic - G_jc); with DR = BC / 2
    also the diagonal block's pairs from its first into its second half (decayed through the middle row m:
    exp(G_i - G_m) exp(G_m - G_j)), the rest of the diagonal block being _kda_diag_kernel's. The blocks right of
    the diagonal block are left unwritten: every reader of M and P masks them (j > i). M is stored by the iq = 0
    program, P at OUT_PREC (as _kda_diag_kernel). One program per (chunk and sub-chunk I, query head of the group,
    kv head), K in blocks of BK: the row factors x_i exp(G_i - G_r0) once per key block, then per earlier sub-chunk
    J < I one tl.dot each against k_j exp(G_r0 - G_j) (r0 = the sub-chunk's first row lies between every j and i: both
    exponents <= 0)."""
    tl.static_assert(BT == 4 * BC)
    tl.static_assert(DR == BC or 2 * DR == BC)
    NS: tl.constexpr = BT // BC
    i_s, iq = tl.program_id(0), tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_t, I = i_s // NS, i_s % NS
    Hq = H * NG
    t0 = i_t * BT
    r0 = t0 + I * BC
    Gb = Gc + i_bh * Tp * K
    kb = k + (i_b * T * H + i_h) * K
    qb = q + (i_b * T * Hq + i_h * NG + iq) * K
    mo = M + (i_bh * Tp + r0) * BT
    po = P + ((i_b * Hq + i_h * NG + iq) * Tp + r0) * BT
    QS = Hq * K
    KS = H * K
    oc = tl.arange(0, BC)
    ri = r0 + oc
    imask = (ri < T)[:, None]
    blk = oc[:, None] * BT + oc[None, :]
    first = (oc * 0 + iq == 0)[:, None]
    mh = tl.zeros([BC, BC], dtype=tl.float32)
    ph = tl.zeros([BC, BC], dtype=tl.float32)
    if I > 0:
        m0 = tl.zeros([BC, BC], dtype=tl.float32)
        p0 = tl.zeros([BC, BC], dtype=tl.float32)
        m1 = tl.zeros([BC, BC], dtype=tl.float32)
        p1 = tl.zeros([BC, BC], dtype=tl.float32)
        m2 = tl.zeros([BC, BC], dtype=tl.float32)
        p2 = tl.zeros([BC, BC], dtype=tl.float32)
        for kk in range(0, K, BK):
            ck = kk + tl.arange(0, BK)
            G_i = tl.load(Gb + ri[:, None] * K + ck[None, :])
            k_i = tl.load(kb + ri[:, None] * KS + ck[None, :], mask=imask, other=0.).to(tl.float32)
            q_i = tl.load(qb + ri[:, None] * QS + ck[None, :], mask=imask, other=0.).to(tl.float32)
            if DR < BC:
                dm, dp = _kda_cross_half_pairs(G_i, k_i, q_i, Gb, r0, ck, K, BC, DR, PREC)
                mh += dm
                ph += dp
            g_r = tl.load(Gb + r0 * K + ck)[None, :]
            e_i = tl.exp(G_i - g_r)
            kx = _to_op(k_i * e_i, PREC)
            qx = _to_op(q_i * e_i, PREC)
            col = _kda_decayed_columns(kb, Gb, g_r, t0, T, ck, KS, K, BC, PREC)
            m0 += _dot(kx, col, PREC)
            p0 += _dot(qx, col, PREC)
            if I > 1:
                col = _kda_decayed_columns(kb, Gb, g_r, t0 + BC, T, ck, KS, K, BC, PREC)
                m1 += _dot(kx, col, PREC)
                p1 += _dot(qx, col, PREC)
            if I > 2:
                col = _kda_decayed_columns(kb, Gb, g_r, t0 + 2 * BC, T, ck, KS, K, BC, PREC)
                m2 += _dot(kx, col, PREC)
                p2 += _dot(qx, col, PREC)
        tl.store(mo + blk, m0, mask=first)
        _store_cast(po + blk, p0, OUT_PREC)
        if I > 1:
            tl.store(mo + BC + blk, m1, mask=first)
            _store_cast(po + BC + blk, p1, OUT_PREC)
        if I > 2:
            tl.store(mo + 2 * BC + blk, m2, mask=first)
            _store_cast(po + 2 * BC + blk, p2, OUT_PREC)
    elif DR < BC:
        for kk in range(0, K, BK):
            ck = kk + tl.arange(0, BK)
            G_i = tl.load(Gb + ri[:, None] * K + ck[None, :])
            k_i = tl.load(kb + ri[:, None] * KS + ck[None, :], mask=imask, other=0.).to(tl.float32)
            q_i = tl.load(qb + ri[:, None] * QS + ck[None, :], mask=imask, other=0.).to(tl.float32)
            dm, dp = _kda_cross_half_pairs(G_i, k_i, q_i, Gb, r0, ck, K, BC, DR, PREC)
            mh += dm
            ph += dp
    if DR < BC:
        quadrant = (oc >= DR)[:, None] & (oc < DR)[None, :]
        tl.store(mo + I * BC + blk, mh, mask=quadrant & first)
        _store_cast(po + I * BC + blk, ph, OUT_PREC, mask=quadrant)


@triton.jit
def _inv_unit_lower(at, BC: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular BC x BC block a, given as its transpose at, by forward
    substitution. Row i of a is then a column of at: extracting it reduces along the axis that the row update
    of the next step broadcasts along, so no step converts a vector between layouts."""
    o = tl.arange(0, BC)
    tm = tl.where(o[:, None] == o[None, :], 1., 0.)
    for i in range(1, BC):
        a_i = tl.sum(tl.where(o[None, :] == i, at, 0.), 1)
        t_i = tl.sum(a_i[:, None] * tm, 0)
        tm = tl.where(o[:, None] == i, tm - t_i[None, :], tm)
    return tm


@triton.jit
def _in_op(x, PREC: tl.constexpr):
    """A loaded input tile as a product operand: as loaded (bf16) on the "bf16" path, fp32 otherwise (the
    bf16 inputs of "bf16emu" need no rounding)."""
    if PREC == "bf16":
        y = x
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _in_block(x, i_b, i_h, T, H, r0, cols, D: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """Rows [r0, r0 + BC) (zeros past T), columns cols of an input [B, T, H, D], as a product operand."""
    r = r0 + tl.arange(0, BC)
    t = tl.load(x + ((i_b * T + r[:, None]) * H + i_h) * D + cols[None, :], mask=(r < T)[:, None], other=0.)
    return _in_op(t, PREC)


@triton.jit
def _beta_rows(beta, i_b, i_h, T, H, r0, BC: tl.constexpr):
    r = r0 + tl.arange(0, BC)
    return tl.load(beta + (i_b * T + r) * H + i_h, mask=r < T, other=0.).to(tl.float32)


@triton.jit
def _kda_m_block(M, i_bh, Tp, t0, I: tl.constexpr, J: tl.constexpr, TRANSPOSED: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr):
    """KDA: sub-block (I, J) of M (its transpose if TRANSPOSED), loaded from the sub-chunk kernel's output."""
    oc = tl.arange(0, BC)
    if TRANSPOSED:
        m = tl.load(M + (i_bh * Tp + t0 + I * BC + oc[None, :]) * BT + J * BC + oc[:, None])
    else:
        m = tl.load(M + (i_bh * Tp + t0 + I * BC + oc[:, None]) * BT + J * BC + oc[None, :])
    return m


@triton.jit
def _gdn_diag_t(m, g, b, BC: tl.constexpr):
    """GDN: the transpose of the diagonal block A_II = diag(beta) (M_II o E) from the symmetric M_II = k_I k_I^T:
    at[j, i] = beta_i M_ij exp(G_i - G_j) for i > j."""
    o = tl.arange(0, BC)
    msk = o[None, :] > o[:, None]
    return tl.where(msk, m * tl.exp(tl.where(msk, g[None, :] - g[:, None], 0.)), 0.) * b[None, :]


@triton.jit
def _store_blk(ptr, i_bh, Tp, t0, I: tl.constexpr, J: tl.constexpr, x, BT: tl.constexpr, BC: tl.constexpr):
    oc = tl.arange(0, BC)
    tl.store(ptr + (i_bh * Tp + t0 + I * BC + oc[:, None]) * BT + J * BC + oc[None, :], x)


@triton.jit
def _store_lower_product(ptr, block_stride, u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, x0, x1, x2, x3,
                         PREC: tl.constexpr):
    """Store T X for a block lower-triangular T (4 x 4 blocks u_IJ, J <= I) and X in 4 row blocks x_J; row block I
    goes to ``ptr + I * block_stride`` (W and U share this, their column factors folded into the u_IJ)."""
    _store_cast(ptr, _dot(u00, x0, PREC), PREC)
    _store_cast(ptr + block_stride, _dot(u10, x0, PREC) + _dot(u11, x1, PREC), PREC)
    _store_cast(ptr + 2 * block_stride, _dot(u20, x0, PREC) + _dot(u21, x1, PREC) + _dot(u22, x2, PREC), PREC)
    _store_cast(ptr + 3 * block_stride, _dot(u30, x0, PREC) + _dot(u31, x1, PREC) + _dot(u32, x2, PREC)
                + _dot(u33, x3, PREC), PREC)


@triton.jit
def _wy_store(out, x, i_b, i_h, i_bh, T, Tp, H, t0, cols, u00, u10, u11, u20, u21, u22, u30, u31, u32, u33,
              D: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """out[rows of the chunk, cols] = T' X for the input x [B, T, H, D] (its chunk rows, columns cols, as loaded)
    and the block lower-triangular T' (blocks u_IJ)."""
    oc = tl.arange(0, BC)
    x0 = _in_block(x, i_b, i_h, T, H, t0, cols, D, BC, PREC)
    x1 = _in_block(x, i_b, i_h, T, H, t0 + BC, cols, D, BC, PREC)
    x2 = _in_block(x, i_b, i_h, T, H, t0 + 2 * BC, cols, D, BC, PREC)
    x3 = _in_block(x, i_b, i_h, T, H, t0 + 3 * BC, cols, D, BC, PREC)
    _store_lower_product(out + (i_bh * Tp + t0 + oc[:, None]) * D + cols[None, :], BC * D,
                         u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, x0, x1, x2, x3, PREC)


@triton.jit
def _kda_wy_keys(k, Gc, Kd, gl, i_b, i_h, i_bh, T, Tp, H, r0, cols, K: tl.constexpr, BC: tl.constexpr,
                 PREC: tl.constexpr):
    """KDA, rows [r0, r0 + BC) and channels cols of a chunk ending with the decays gl (G of its last row): stores
    Kd = k exp(G_last - G) and returns exp(G) k as a product operand (W's right factor), from one load of k and G."""
    r = r0 + tl.arange(0, BC)
    G = tl.load(Gc + (i_bh * Tp + r[:, None]) * K + cols[None, :])
    k_r = _in_block(k, i_b, i_h, T, H, r0, cols, K, BC, "ieee")
    _store_cast(Kd + (i_bh * Tp + r[:, None]) * K + cols[None, :], k_r * tl.exp(gl[None, :] - G), PREC)
    return _to_op(tl.exp(G) * k_r, PREC)


@triton.jit
def _solve_wy_kernel(k, v, beta, Gc, M, Tinv, W, U, Kd, T, Tp, H, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     STORE_T: tl.constexpr, PREC: tl.constexpr, PREC_HI: tl.constexpr, BKW: tl.constexpr):
    """T = (I + diag(beta) M)^-1 blockwise (BT = 4 BC: diagonal BC-blocks by forward substitution, then
    T_IJ = -T_II sum_{J <= L < I} A_IL T_LJ); W = T (beta exp(G) k); U = T (beta v).
    GDN forms the 10 blocks M_IJ = k_I k_J^T (J <= I) itself, K in blocks of BKW with the key tiles as loaded
    (bf16 product operands on the bf16 path); the decays of an off-diagonal block factor about the block row's
    first row m, exp(G_i - G_m) exp(G_m - G_j) (both exponents <= 0), so only vectors are exponentiated there.
    The column factors of the products are folded into T's blocks: W = (T diag(beta exp(G))) k and
    U = (T diag(beta)) v (KDA: W = (T diag(beta)) (exp(G) k), per-channel decays), so the key and value tiles
    of W and U enter the products as loaded."""
    tl.static_assert(BT == 4 * BC)
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    t0 = i_t * BT
    oc = tl.arange(0, BC)
    b0 = _beta_rows(beta, i_b, i_h, T, H, t0, BC)
    b1 = _beta_rows(beta, i_b, i_h, T, H, t0 + BC, BC)
    b2 = _beta_rows(beta, i_b, i_h, T, H, t0 + 2 * BC, BC)
    b3 = _beta_rows(beta, i_b, i_h, T, H, t0 + 3 * BC, BC)
    if PER_CHANNEL:
        at00 = _kda_m_block(M, i_bh, Tp, t0, 0, 0, True, BT, BC) * b0[None, :]
        at11 = _kda_m_block(M, i_bh, Tp, t0, 1, 1, True, BT, BC) * b1[None, :]
        at22 = _kda_m_block(M, i_bh, Tp, t0, 2, 2, True, BT, BC) * b2[None, :]
        at33 = _kda_m_block(M, i_bh, Tp, t0, 3, 3, True, BT, BC) * b3[None, :]
        a10 = _kda_m_block(M, i_bh, Tp, t0, 1, 0, False, BT, BC) * b1[:, None]
        a20 = _kda_m_block(M, i_bh, Tp, t0, 2, 0, False, BT, BC) * b2[:, None]
        a21 = _kda_m_block(M, i_bh, Tp, t0, 2, 1, False, BT, BC) * b2[:, None]
        a30 = _kda_m_block(M, i_bh, Tp, t0, 3, 0, False, BT, BC) * b3[:, None]
        a31 = _kda_m_block(M, i_bh, Tp, t0, 3, 1, False, BT, BC) * b3[:, None]
        a32 = _kda_m_block(M, i_bh, Tp, t0, 3, 2, False, BT, BC) * b3[:, None]
    else:
        m00 = tl.zeros([BC, BC], dtype=tl.float32)
        m11 = tl.zeros([BC, BC], dtype=tl.float32)
        m22 = tl.zeros([BC, BC], dtype=tl.float32)
        m33 = tl.zeros([BC, BC], dtype=tl.float32)
        m10 = tl.zeros([BC, BC], dtype=tl.float32)
        m20 = tl.zeros([BC, BC], dtype=tl.float32)
        m21 = tl.zeros([BC, BC], dtype=tl.float32)
        m30 = tl.zeros([BC, BC], dtype=tl.float32)
        m31 = tl.zeros([BC, BC], dtype=tl.float32)
        m32 = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, K, BKW):
            ckb = i_k + tl.arange(0, BKW)
            k0 = _in_block(k, i_b, i_h, T, H, t0, ckb, K, BC, PREC)
            k1 = _in_block(k, i_b, i_h, T, H, t0 + BC, ckb, K, BC, PREC)
            k2 = _in_block(k, i_b, i_h, T, H, t0 + 2 * BC, ckb, K, BC, PREC)
            k3 = _in_block(k, i_b, i_h, T, H, t0 + 3 * BC, ckb, K, BC, PREC)
            m00 += _dot(k0, tl.trans(k0), PREC)
            m11 += _dot(k1, tl.trans(k1), PREC)
            m22 += _dot(k2, tl.trans(k2), PREC)
            m33 += _dot(k3, tl.trans(k3), PREC)
            m10 += _dot(k1, tl.trans(k0), PREC)
            m20 += _dot(k2, tl.trans(k0), PREC)
            m21 += _dot(k2, tl.trans(k1), PREC)
            m30 += _dot(k3, tl.trans(k0), PREC)
            m31 += _dot(k3, tl.trans(k1), PREC)
            m32 += _dot(k3, tl.trans(k2), PREC)
        g0 = tl.load(Gc + i_bh * Tp + t0 + oc)
        g1 = tl.load(Gc + i_bh * Tp + t0 + BC + oc)
        g2 = tl.load(Gc + i_bh * Tp + t0 + 2 * BC + oc)
        g3 = tl.load(Gc + i_bh * Tp + t0 + 3 * BC + oc)
        at00 = _gdn_diag_t(m00, g0, b0, BC)
        at11 = _gdn_diag_t(m11, g1, b1, BC)
        at22 = _gdn_diag_t(m22, g2, b2, BC)
        at33 = _gdn_diag_t(m33, g3, b3, BC)
        # off-diagonal decays about the first row of block row I (gm_I): rows exp(G_i - gm_I), columns exp(gm_I - G_j)
        gm1 = tl.load(Gc + i_bh * Tp + t0 + BC)
        gm2 = tl.load(Gc + i_bh * Tp + t0 + 2 * BC)
        gm3 = tl.load(Gc + i_bh * Tp + t0 + 3 * BC)
        r1 = (b1 * tl.exp(g1 - gm1))[:, None]
        r2 = (b2 * tl.exp(g2 - gm2))[:, None]
        r3 = (b3 * tl.exp(g3 - gm3))[:, None]
        a10 = r1 * m10 * tl.exp(gm1 - g0)[None, :]
        a20 = r2 * m20 * tl.exp(gm2 - g0)[None, :]
        a21 = r2 * m21 * tl.exp(gm2 - g1)[None, :]
        a30 = r3 * m30 * tl.exp(gm3 - g0)[None, :]
        a31 = r3 * m31 * tl.exp(gm3 - g1)[None, :]
        a32 = r3 * m32 * tl.exp(gm3 - g2)[None, :]
    t00 = _inv_unit_lower(at00, BC)
    t11 = _inv_unit_lower(at11, BC)
    t22 = _inv_unit_lower(at22, BC)
    t33 = _inv_unit_lower(at33, BC)
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
    # U = (T diag(beta)) v: T's blocks with beta folded into their columns, as product operands (bf16 on the bf16
    # path), cast once
    c0, c1, c2, c3 = b0[None, :], b1[None, :], b2[None, :], b3[None, :]
    u00, u10, u11 = _to_op(t00 * c0, PREC), _to_op(t10 * c0, PREC), _to_op(t11 * c1, PREC)
    u20, u21, u22 = _to_op(t20 * c0, PREC), _to_op(t21 * c1, PREC), _to_op(t22 * c2, PREC)
    u30, u31, u32, u33 = _to_op(t30 * c0, PREC), _to_op(t31 * c1, PREC), _to_op(t32 * c2, PREC), _to_op(t33 * c3, PREC)
    for i_v in range(0, V, BV):
        _wy_store(U, v, i_b, i_h, i_bh, T, Tp, H, t0, i_v + tl.arange(0, BV),
                  u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, V, BC, PREC)
    if PER_CHANNEL:
        # W = (T diag(beta)) (exp(G) k), and Kd = k exp(G_last - G), the keys as they enter the state at the end
        # of the chunk (for the state passes): both from one load of each row block's keys and decays
        for i_k in range(0, K, BKW):
            ckb = i_k + tl.arange(0, BKW)
            gl = tl.load(Gc + (i_bh * Tp + t0 + BT - 1) * K + ckb)
            kg0 = _kda_wy_keys(k, Gc, Kd, gl, i_b, i_h, i_bh, T, Tp, H, t0, ckb, K, BC, PREC)
            kg1 = _kda_wy_keys(k, Gc, Kd, gl, i_b, i_h, i_bh, T, Tp, H, t0 + BC, ckb, K, BC, PREC)
            kg2 = _kda_wy_keys(k, Gc, Kd, gl, i_b, i_h, i_bh, T, Tp, H, t0 + 2 * BC, ckb, K, BC, PREC)
            kg3 = _kda_wy_keys(k, Gc, Kd, gl, i_b, i_h, i_bh, T, Tp, H, t0 + 3 * BC, ckb, K, BC, PREC)
            _store_lower_product(W + (i_bh * Tp + t0 + oc[:, None]) * K + ckb[None, :], BC * K,
                                 u00, u10, u11, u20, u21, u22, u30, u31, u32, u33, kg0, kg1, kg2, kg3, PREC)
    else:
        # W = (T diag(beta exp(G))) k, T's operands formed after U's so that only one set is live at a time
        e0 = c0 * tl.exp(g0)[None, :]
        e1 = c1 * tl.exp(g1)[None, :]
        e2 = c2 * tl.exp(g2)[None, :]
        e3 = c3 * tl.exp(g3)[None, :]
        w00, w10, w11 = _to_op(t00 * e0, PREC), _to_op(t10 * e0, PREC), _to_op(t11 * e1, PREC)
        w20, w21, w22 = _to_op(t20 * e0, PREC), _to_op(t21 * e1, PREC), _to_op(t22 * e2, PREC)
        w30, w31, w32, w33 = _to_op(t30 * e0, PREC), _to_op(t31 * e1, PREC), _to_op(t32 * e2, PREC), _to_op(t33 * e3, PREC)
        for i_k in range(0, K, BKW):
            _wy_store(W, k, i_b, i_h, i_bh, T, Tp, H, t0, i_k + tl.arange(0, BKW),
                      w00, w10, w11, w20, w21, w22, w30, w31, w32, w33, K, BC, PREC)


@triton.jit
def _state_fwd_kernel(k, Kd, Gc, W, U, Hs, Vp, h0, hT, T, Tp, NT, H, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_H0: tl.constexpr,
                      PREC: tl.constexpr):
    """Sequential pass over chunks for one (batch, kv head, V block): stores the state entering each
    chunk (Hs) and the pseudo-values V' = U - W S; writes the final state. GDN takes the keys as loaded (bf16
    product operands on the bf16 path) and applies the decays exp(G_last - G) to V' instead."""
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
            s += _dot(tl.trans(kd), vp, PREC)
        else:
            # (k exp(G_last - G))^T V' = k^T (exp(G_last - G) V'): the decay scales the [BT, BV] rows of V' rather
            # than the [BT, K] key tile, which enters the product as loaded
            k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.)
            G = tl.load(Gc + i_bh * Tp + rows)
            gl = tl.load(Gc + i_bh * Tp + last)
            s = s * tl.exp(gl)
            s += _dot(tl.trans(_in_op(k_c, PREC)), vp * tl.exp(gl - G)[:, None], PREC)
    tl.store(hT + (i_bh * K + ck[:, None]) * V + cv[None, :], s)


@triton.jit
def _output_kernel(q, k, Gc, QG, P, Hs, Vp, o_ptr, scale, T, Tp, NT, H, NG, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """O = scale [ (q exp(G)) S + P V' ] for one (V block, chunk, batch * query head). KDA reads its decayed
    queries QG = scale q exp(G) and P from _kda_diag / _kda_intra (O = QG S + scale P V', no exps here); GDN forms
    q exp(G) and P = (q k^T) o E from q, k and its scalar G."""
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
    # each path loads its tiles in its own order: KDA's S and V' ahead of QG and P take 80 registers against 88
    # with QG first (bf16, NG = 1, offline sm_90 compile, triton 3.9); GDN's order is the one it was measured with
    if PER_CHANNEL:
        s = tl.load(Hs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :])
        vp = tl.load(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        qg = tl.load(QG + (i_bhq * Tp + rows[:, None]) * K + ck[None, :])
        p = _causal(tl.load(P + (i_bhq * Tp + rows[:, None]) * BT + o[None, :]), BT)
        acc = _dot(qg, s, PREC) + scale * _dot(p, vp, PREC)
    else:
        q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None],
                      other=0.).to(tl.float32)
        s = tl.load(Hs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :])
        G = tl.load(Gc + i_bh * Tp + rows)
        qe = q_c * tl.exp(G)[:, None]
        k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None],
                      other=0.).to(tl.float32)
        p = _dot(q_c, tl.trans(k_c), PREC) * _gdn_decay(G, False, BT)
        vp = tl.load(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        acc = scale * (_dot(qe, s, PREC) + _dot(p, vp, PREC))
    if PREC == "bf16emu":
        acc = _round_bf16(acc)
    tl.store(o_ptr + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
