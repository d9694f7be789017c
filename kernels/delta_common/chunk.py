"""Chunked Triton kernels of the gated delta rule: GDN (scalar decay, PER_CHANNEL=False) and KDA
(per-channel decay, PER_CHANNEL=True), forward and backward.

Math: shared/design/gated_delta_rule.md. Per chunk of BT rows with state S entering it, G = cumsum(g)
inside the chunk (fp32), and the decayed products (scalar decay: E_ij = exp(G_i - G_j); KDA: per channel)
    M_ij = sum_c k_ic k_jc E_ijc   (j < i)          A = diag(beta) M
    P_ij = sum_c q_ic k_jc E_ijc   (j <= i)
    T = (I + A)^-1,  W = T (beta exp(G) k),  U = T (beta v)
    V' = U - W S
    O = scale [ (q exp(G)) S + P V' ]
    S <- exp(G_last) S + (k exp(G_last - G))^T V'
Only differences G_i - G_j with j <= i (and G_last - G_i) are ever exponentiated. For KDA the
per-channel products are formed per sub-chunk of BC rows against a reference row of G inside the
sub-chunk (both factors then have non-positive exponents); the BC x BC diagonal blocks are formed
column by column.

Kernel plan (grid in brackets; "bh" = batch * kv heads, "bhq" = batch * query heads, NS = BT / BC):
  forward:  _cumsum [NT, bh] -> (KDA) _kda_intra [NT*NS, 1 + NG, bh] (M, and P per query head)
            -> _solve_wy [NT, bh] (T, W, U; KDA also k exp(G_last - G))
            -> _state_fwd [V/BV, bh] (sequential over chunks) -> _output [V/BV, NT, bhq]
  backward: recompute the forward up to _state_fwd (keeping T, h, V'), then
            _dv_local [V/BV, NT, bh] -> _state_bwd [V/BV, bh] (reverse over chunks)
            -> _bwd_dqk [NT, bh] -> _bwd_wy [NT, bh] -> (KDA) _kda_intra_bwd [NT*NS, bh]
            -> _rev_cumsum [NT, bh] (dg from dG)
Intermediates live in padded buffers [B, H, NT*BT, ...] (fp32); padded rows have k = v = q = beta = 0
and g = 0, which makes them exact no-ops. Nothing is kept from the forward for the backward but the inputs.
Every tl.dot takes fp32 operands: exact ("ieee") for fp32 inputs, TF32 for bf16/fp16 inputs.
On an H200 (B=1, T=16384, H=32, K=V=128, bf16) the sequential state passes, KDA's sub-chunk kernels
(_kda_intra, _kda_intra_bwd) and the register-heavy backward kernels (_bwd_dqk, _bwd_wy) dominate the time.

Grouped query heads: q has Hq = NG * H heads; query head hq reads kv head hq // NG.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tunable launch constants (Hopper defaults).
CHUNK = 64          # BT: rows per chunk (tl.dot blocks of 64)
SUB_CHUNK = 16      # BC: KDA sub-chunk for the per-channel decayed products
BLOCK_V = 32        # BV: value-dimension block of the sequential state kernels and the backward chunk kernels
BLOCK_V_OUT = 64    # value-dimension block of _output and _dv_local (each V block recomputes GDN's P)
KDA_BK = 64         # key-dimension block of KDA's sub-chunk kernels
NUM_WARPS = 4
NUM_STAGES = 2
# warps per kernel (the register-heavy kernels get 8 to avoid spills at K = V = 128)
WARPS = {"cumsum": 4, "kda_intra": 4, "solve_wy": 4, "state_fwd": 4, "output": 4, "dv_local": 4,
         "state_bwd": 8, "bwd_dqk": 8, "bwd_wy": 8, "kda_intra_bwd": 8, "rev_cumsum": 4}
# tl.dot input precision for float32 operands: inputs in float32 use exact ("ieee") products;
# for bf16/fp16 inputs the fp32 intermediates go through TF32 tensor cores.
FP32_INPUT_DOT_PRECISION = "ieee"
LOW_PRECISION_INPUT_DOT_PRECISION = "tf32"


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _cumsum_kernel(g, Gc, T, Tp, H, K: tl.constexpr, BT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_t * BT + tl.arange(0, BT)
    rmask = rows < T
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
def _kda_intra_kernel(q, k, Gc, M, P, T, Tp, H, NG, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                      BK: tl.constexpr, PREC: tl.constexpr):
    """KDA: rows [r0, r0 + BC) of M (role 0: x = k, j < i) or of P (role 1 + iq: x = q of the group's
    query head iq, j <= i), M_ij / P_ij = sum_c x_ic k_jc exp(G_ic - G_jc).
    Off-diagonal sub-blocks: one tl.dot against the reference row r0 (both exponents <= 0);
    the BC x BC diagonal block column by column, elementwise; K in blocks of BK."""
    NS: tl.constexpr = BT // BC
    i_tc, role = tl.program_id(0), tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    i_t, i_i = i_tc // NS, i_tc % NS
    t0 = i_t * BT
    r0 = t0 + i_i * BC
    oc = tl.arange(0, BC)
    ri = r0 + oc
    ra = t0 + tl.arange(0, BT)
    la = tl.arange(0, BT)
    lb = i_i * BC + oc
    imask = (ri < T)[:, None]
    amask = (ra < T)[:, None]
    Gb = Gc + i_bh * Tp * K
    kb = k + (i_b * T * H + i_h) * K
    if role == 0:
        xb = k + (i_b * T * H + i_h) * K
        xs = H * K
    else:
        xb = q + (i_b * T * Hq + i_h * NG + role - 1) * K
        xs = Hq * K
    jm = (ra < r0)[:, None]
    acc = tl.zeros([BC, BT], dtype=tl.float32)
    accd = tl.zeros([BC, BC], dtype=tl.float32)
    for kk in range(0, K, BK):
        ck = kk + tl.arange(0, BK)
        G_i = tl.load(Gb + ri[:, None] * K + ck[None, :])
        G_a = tl.load(Gb + ra[:, None] * K + ck[None, :])
        g_r = tl.load(Gb + r0 * K + ck)
        x_i = tl.load(xb + ri[:, None] * xs + ck[None, :], mask=imask, other=0.).to(tl.float32)
        k_a = tl.load(kb + ra[:, None] * (H * K) + ck[None, :], mask=amask, other=0.).to(tl.float32)
        k_r = tl.where(jm, k_a * tl.exp(tl.where(jm, g_r[None, :] - G_a, 0.)), 0.)
        acc += tl.dot(x_i * tl.exp(G_i - g_r[None, :]), tl.trans(k_r), input_precision=PREC)
        # diagonal block, one column j at a time
        for jj in range(BC):
            j = r0 + jj
            k_j = tl.load(kb + j * (H * K) + ck, mask=(ck * 0 + j) < T, other=0.).to(tl.float32)
            g_j = tl.load(Gb + j * K + ck)
            sm = ((ri > j) | ((ri == j) & (ri * 0 + role > 0)))[:, None]
            col = tl.sum(tl.where(sm, x_i * k_j[None, :] * tl.exp(tl.where(sm, G_i - g_j[None, :], 0.)), 0.), 1)
            accd += tl.where(oc[None, :] == jj, col[:, None], 0.)
    if role == 0:
        ob = M + (i_bh * Tp + ri) * BT
    else:
        ob = P + ((i_b * Hq + i_h * NG + role - 1) * Tp + ri) * BT
    offd = (la < i_i * BC) | (la >= i_i * BC + BC)
    tl.store(ob[:, None] + la[None, :], acc, mask=offd[None, :])
    tl.store(ob[:, None] + lb[None, :], accd)


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
        m = tl.where(msk, tl.dot(k_i, tl.trans(k_j), input_precision=PREC)
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
def _kg_block(k_i, beta, Gc, i_b, i_h, i_bh, T, Tp, H, r0, K: tl.constexpr, BC: tl.constexpr,
              PER_CHANNEL: tl.constexpr):
    """beta * exp(G) * k on rows [r0, r0 + BC) (k_i: those rows of k)."""
    r = r0 + tl.arange(0, BC)
    b_i = tl.load(beta + (i_b * T + r) * H + i_h, mask=r < T, other=0.).to(tl.float32)
    if PER_CHANNEL:
        ck = tl.arange(0, K)
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
def _solve_wy_kernel(k, v, beta, Gc, M, Tinv, W, U, Kd, T, Tp, H, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr,
                     STORE_T: tl.constexpr, PREC: tl.constexpr):
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
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=PREC), input_precision=PREC)
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=PREC), input_precision=PREC)
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=PREC), input_precision=PREC)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=PREC) + tl.dot(a21, t10, input_precision=PREC),
                  input_precision=PREC)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=PREC) + tl.dot(a32, t21, input_precision=PREC),
                  input_precision=PREC)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=PREC) + tl.dot(a31, t10, input_precision=PREC)
                  + tl.dot(a32, t20, input_precision=PREC), input_precision=PREC)
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
    ck = tl.arange(0, K)
    kg0 = _kg_block(k0, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0, K, BC, PER_CHANNEL)
    kg1 = _kg_block(k1, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0 + BC, K, BC, PER_CHANNEL)
    kg2 = _kg_block(k2, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0 + 2 * BC, K, BC, PER_CHANNEL)
    kg3 = _kg_block(k3, beta, Gc, i_b, i_h, i_bh, T, Tp, H, t0 + 3 * BC, K, BC, PER_CHANNEL)
    # KDA: k exp(G_last - G), the keys as they enter the state at the end of the chunk (for _state_fwd)
    if PER_CHANNEL:
        kdb = Kd + (i_bh * Tp + t0 + oc[:, None]) * K + ck[None, :]
        gl = tl.load(Gc + (i_bh * Tp + t0 + BT - 1) * K + ck)
        gb = Gc + (i_bh * Tp + t0 + oc[:, None]) * K + ck[None, :]
        tl.store(kdb, k0 * tl.exp(gl[None, :] - tl.load(gb)))
        tl.store(kdb + BC * K, k1 * tl.exp(gl[None, :] - tl.load(gb + BC * K)))
        tl.store(kdb + 2 * BC * K, k2 * tl.exp(gl[None, :] - tl.load(gb + 2 * BC * K)))
        tl.store(kdb + 3 * BC * K, k3 * tl.exp(gl[None, :] - tl.load(gb + 3 * BC * K)))
    wb = W + (i_bh * Tp + t0 + oc[:, None]) * K + ck[None, :]
    tl.store(wb, tl.dot(t00, kg0, input_precision=PREC))
    tl.store(wb + BC * K, tl.dot(t10, kg0, input_precision=PREC) + tl.dot(t11, kg1, input_precision=PREC))
    tl.store(wb + 2 * BC * K, tl.dot(t20, kg0, input_precision=PREC) + tl.dot(t21, kg1, input_precision=PREC)
             + tl.dot(t22, kg2, input_precision=PREC))
    tl.store(wb + 3 * BC * K, tl.dot(t30, kg0, input_precision=PREC) + tl.dot(t31, kg1, input_precision=PREC)
             + tl.dot(t32, kg2, input_precision=PREC) + tl.dot(t33, kg3, input_precision=PREC))
    for i_v in range(0, V, BV):
        cv = i_v + tl.arange(0, BV)
        bv0 = _bv_block(v, beta, i_b, i_h, T, H, t0, cv, V, BC)
        bv1 = _bv_block(v, beta, i_b, i_h, T, H, t0 + BC, cv, V, BC)
        bv2 = _bv_block(v, beta, i_b, i_h, T, H, t0 + 2 * BC, cv, V, BC)
        bv3 = _bv_block(v, beta, i_b, i_h, T, H, t0 + 3 * BC, cv, V, BC)
        ub = U + (i_bh * Tp + t0 + oc[:, None]) * V + cv[None, :]
        tl.store(ub, tl.dot(t00, bv0, input_precision=PREC))
        tl.store(ub + BC * V, tl.dot(t10, bv0, input_precision=PREC) + tl.dot(t11, bv1, input_precision=PREC))
        tl.store(ub + 2 * BC * V, tl.dot(t20, bv0, input_precision=PREC) + tl.dot(t21, bv1, input_precision=PREC)
                 + tl.dot(t22, bv2, input_precision=PREC))
        tl.store(ub + 3 * BC * V, tl.dot(t30, bv0, input_precision=PREC) + tl.dot(t31, bv1, input_precision=PREC)
                 + tl.dot(t32, bv2, input_precision=PREC) + tl.dot(t33, bv3, input_precision=PREC))


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
        tl.store(Hs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :], s)
        w = tl.load(W + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        u = tl.load(U + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        vp = u - tl.dot(w, s, input_precision=PREC)
        tl.store(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :], vp)
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
        s += tl.dot(tl.trans(kd), vp, input_precision=PREC)
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
        p = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * _gdn_decay(G, False, BT)
    vp = tl.load(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
    acc = tl.dot(qe, s, input_precision=PREC) + tl.dot(p, vp, input_precision=PREC)
    tl.store(o_ptr + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :],
             (scale * acc).to(o_ptr.dtype.element_ty), mask=rmask[:, None])


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _dv_local_kernel(q, k, Gc, P, do, dVl, scale, T, Tp, H, NG, K: tl.constexpr, V: tl.constexpr,
                     BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """dV'_local = scale * sum over the group's query heads of P^T dO."""
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
            p = tl.load(P + ((i_b * Hq + i_hq) * Tp + rows[:, None]) * BT + o[None, :])
        else:
            q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
            p = tl.dot(q_c, tl.trans(k_c), input_precision=PREC) * dec
        do_c = tl.load(do + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        acc += tl.dot(tl.trans(p), do_c, input_precision=PREC)
    tl.store(dVl + (i_bh * Tp + rows[:, None]) * V + cv[None, :], scale * acc)


@triton.jit
def _state_bwd_kernel(q, k, Gc, W, dVl, do, dHs, dVp, dhT, dh0, scale, T, Tp, NT, H, NG, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr,
                      HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """Reverse pass over chunks: dHs[c] = gradient of the state leaving chunk c,
    dV' = dV'_local + (k exp(G_last - G)) dS', dS <- exp(G_last) dS' + scale (q exp(G))^T dO - W^T dV'."""
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
    for it in range(NT):
        i_t = NT - 1 - it
        rows = i_t * BT + o
        rmask = rows < T
        tl.store(dHs + ((i_bh * NT + i_t) * K + ck[:, None]) * V + cv[None, :], dh)
        k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        last = i_t * BT + BT - 1
        if PER_CHANNEL:
            G = tl.load(Gc + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
            gl = tl.load(Gc + (i_bh * Tp + last) * K + ck)
            kd = k_c * tl.exp(gl[None, :] - G)
            eg = tl.exp(G)
        else:
            G = tl.load(Gc + i_bh * Tp + rows)
            gl = tl.load(Gc + i_bh * Tp + last)
            kd = k_c * tl.exp(gl - G)[:, None]
            eg = tl.exp(G)[:, None]
        dvp = tl.load(dVl + (i_bh * Tp + rows[:, None]) * V + cv[None, :]) + tl.dot(kd, dh, input_precision=PREC)
        tl.store(dVp + (i_bh * Tp + rows[:, None]) * V + cv[None, :], dvp)
        qdo = tl.zeros([K, BV], dtype=tl.float32)
        for iq in range(NG):
            i_hq = i_h * NG + iq
            q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
            do_c = tl.load(do + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
            qdo += tl.dot(tl.trans(q_c * eg), do_c, input_precision=PREC)
        w = tl.load(W + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        if PER_CHANNEL:
            dh = dh * tl.exp(gl)[:, None]
        else:
            dh = dh * tl.exp(gl)
        dh += scale * qdo - tl.dot(tl.trans(w), dvp, input_precision=PREC)
    tl.store(dh0 + (i_bh * K + ck[:, None]) * V + cv[None, :], dh)


@triton.jit
def _bwd_dqk_kernel(q, k, Gc, Hs, dHs, Vp, dVp, do, dq, dk, dW, dG, dP, scale, T, Tp, NT, H, NG,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                    PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: dW = -dV' S^T; the state-path parts of dq, dk, dG; dP (stored for KDA, consumed here for GDN)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    o = tl.arange(0, BT)
    rows = i_t * BT + o
    rmask = rows < T
    ck = tl.arange(0, K)
    hbase = (i_bh * NT + i_t) * K
    k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
    # dW = -dV' S^T
    dw = tl.zeros([BT, K], dtype=tl.float32)
    for i_v in range(0, V, BV):
        cv = i_v + tl.arange(0, BV)
        hb = tl.load(Hs + (hbase + ck[:, None]) * V + cv[None, :])
        dvp = tl.load(dVp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        dw -= tl.dot(dvp, tl.trans(hb), input_precision=PREC)
    tl.store(dW + (i_bh * Tp + rows[:, None]) * K + ck[None, :], dw)
    # state update: dKd = V' dS'^T, d exp(G_last) = sum_v S dS'
    dkd = tl.zeros([BT, K], dtype=tl.float32)
    dd = tl.zeros([K], dtype=tl.float32)
    for i_v in range(0, V, BV):
        cv = i_v + tl.arange(0, BV)
        hb = tl.load(Hs + (hbase + ck[:, None]) * V + cv[None, :])
        dhb = tl.load(dHs + (hbase + ck[:, None]) * V + cv[None, :])
        vp = tl.load(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        dkd += tl.dot(vp, tl.trans(dhb), input_precision=PREC)
        dd += tl.sum(hb * dhb, 1)
    last = i_t * BT + BT - 1
    if PER_CHANNEL:
        G = tl.load(Gc + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        gl = tl.load(Gc + (i_bh * Tp + last) * K + ck)
        dk_acc = dkd * tl.exp(gl[None, :] - G)
        dg_acc = -k_c * dk_acc
        last_add = tl.sum(k_c * dk_acc, 0) + tl.exp(gl) * dd
        dg_acc = tl.where(o[:, None] == BT - 1, dg_acc + last_add[None, :], dg_acc)
        eg = tl.exp(G)
    else:
        G = tl.load(Gc + i_bh * Tp + rows)
        gl = tl.load(Gc + i_bh * Tp + last)
        dk_acc = dkd * tl.exp(gl - G)[:, None]
        dg_acc = -tl.sum(k_c * dk_acc, 1)
        last_add = tl.sum(tl.sum(k_c * dk_acc, 1), 0) + tl.exp(gl) * tl.sum(dd, 0)
        dg_acc = tl.where(o == BT - 1, dg_acc + last_add, dg_acc)
        eg = tl.exp(G)[:, None]
        dec = _gdn_decay(G, False, BT)
        dkb = tl.zeros([BT, K], dtype=tl.float32)
    causal = o[:, None] >= o[None, :]
    for iq in range(NG):
        i_hq = i_h * NG + iq
        q_c = tl.load(q + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        dqs = tl.zeros([BT, K], dtype=tl.float32)
        dp = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(0, V, BV):
            cv = i_v + tl.arange(0, BV)
            hb = tl.load(Hs + (hbase + ck[:, None]) * V + cv[None, :])
            vp = tl.load(Vp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
            do_c = tl.load(do + ((i_b * T + rows[:, None]) * Hq + i_hq) * V + cv[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
            dqs += tl.dot(do_c, tl.trans(hb), input_precision=PREC)
            dp += tl.dot(do_c, tl.trans(vp), input_precision=PREC)
        dqs = scale * dqs * eg
        dp = tl.where(causal, scale * dp, 0.)
        if PER_CHANNEL:
            dg_acc += q_c * dqs
            tl.store(dP + ((i_b * Hq + i_hq) * Tp + rows[:, None]) * BT + o[None, :], dp)
            dq_c = dqs
        else:
            dpg = dp * dec
            dqb = tl.dot(dpg, k_c, input_precision=PREC)
            dkb += tl.dot(tl.trans(dpg), q_c, input_precision=PREC)
            dg_acc += tl.sum(q_c * (dqs + dqb), 1)
            dq_c = dqs + dqb
        tl.store(dq + ((i_b * T + rows[:, None]) * Hq + i_hq) * K + ck[None, :], dq_c, mask=rmask[:, None])
    if PER_CHANNEL:
        tl.store(dG + (i_bh * Tp + rows[:, None]) * K + ck[None, :], dg_acc)
    else:
        dk_acc += dkb
        dg_acc -= tl.sum(k_c * dkb, 1)
        tl.store(dG + i_bh * Tp + rows, dg_acc)
    tl.store(dk + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], dk_acc, mask=rmask[:, None])


@triton.jit
def _bwd_wy_kernel(k, v, beta, Gc, M, Tinv, dW, dVp, dk, dv, dbeta, dG, dM, T, Tp, H,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                   PER_CHANNEL: tl.constexpr, PREC: tl.constexpr):
    """Backward of W = T (beta exp(G) k), U = T (beta v), T = (I + diag(beta) M)^-1."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o = tl.arange(0, BT)
    rows = i_t * BT + o
    rmask = rows < T
    ck = tl.arange(0, K)
    k_c = tl.load(k + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
    b_c = tl.load(beta + (i_b * T + rows) * H + i_h, mask=rmask, other=0.).to(tl.float32)
    tm = tl.load(Tinv + (i_bh * Tp + rows[:, None]) * BT + o[None, :])
    dw = tl.load(dW + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
    if PER_CHANNEL:
        G = tl.load(Gc + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        eg = tl.exp(G)
    else:
        G = tl.load(Gc + i_bh * Tp + rows)
        eg = tl.exp(G)[:, None]
    kg = b_c[:, None] * eg * k_c
    dkg = tl.dot(tl.trans(tm), dw, input_precision=PREC)
    dt = tl.dot(dw, tl.trans(kg), input_precision=PREC)
    db = tl.sum(eg * k_c * dkg, 1)
    dk_acc = b_c[:, None] * eg * dkg
    for i_v in range(0, V, BV):
        cv = i_v + tl.arange(0, BV)
        du = tl.load(dVp + (i_bh * Tp + rows[:, None]) * V + cv[None, :])
        v_c = tl.load(v + ((i_b * T + rows[:, None]) * H + i_h) * V + cv[None, :], mask=rmask[:, None], other=0.).to(tl.float32)
        dt += tl.dot(du, tl.trans(b_c[:, None] * v_c), input_precision=PREC)
        dbv = tl.dot(tl.trans(tm), du, input_precision=PREC)
        db += tl.sum(v_c * dbv, 1)
        tl.store(dv + ((i_b * T + rows[:, None]) * H + i_h) * V + cv[None, :],
                 (b_c[:, None] * dbv).to(dv.dtype.element_ty), mask=rmask[:, None])
    strict = o[:, None] > o[None, :]
    da = tl.dot(tl.dot(tl.trans(tm), dt, input_precision=PREC), tl.trans(tm), input_precision=PREC)
    da = tl.where(strict, -da, 0.)
    if PER_CHANNEL:
        m = tl.load(M + (i_bh * Tp + rows[:, None]) * BT + o[None, :])
    else:
        dec = _gdn_decay(G, True, BT)
        m = tl.dot(k_c, tl.trans(k_c), input_precision=PREC) * dec
    db += tl.sum(da * m, 1)
    dm = b_c[:, None] * da
    dk_prev = tl.load(dk + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], mask=rmask[:, None], other=0.)
    if PER_CHANNEL:
        tl.store(dM + (i_bh * Tp + rows[:, None]) * BT + o[None, :], dm)
        dg_add = k_c * dk_acc
        dgp = tl.load(dG + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        tl.store(dG + (i_bh * Tp + rows[:, None]) * K + ck[None, :], dgp + dg_add)
    else:
        dmg = dm * dec
        dkr = tl.dot(dmg, k_c, input_precision=PREC)
        dkc = tl.dot(tl.trans(dmg), k_c, input_precision=PREC)
        dg_add = tl.sum(k_c * (dk_acc + dkr - dkc), 1)
        dk_acc += dkr + dkc
        dgp = tl.load(dG + i_bh * Tp + rows)
        tl.store(dG + i_bh * Tp + rows, dgp + dg_add)
    tl.store(dk + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], dk_prev + dk_acc, mask=rmask[:, None])
    tl.store(dbeta + (i_b * T + rows) * H + i_h, db, mask=rmask)


@triton.jit
def _kda_intra_bwd_kernel(q, k, Gc, dP, dM, dq, dk, dG, T, Tp, H, NG, K: tl.constexpr, BT: tl.constexpr,
                          BC: tl.constexpr, PREC: tl.constexpr):
    """KDA: gradients through the per-channel decayed products M (from dM) and P (from dP) for the rows
    of one sub-chunk, in their row role (i: reference row r0) and their column role (j: reference row
    r0 + BC - 1); the diagonal block elementwise, one row/column at a time. Adds into dq, dk and dG."""
    NS: tl.constexpr = BT // BC
    i_tc = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    Hq = H * NG
    i_t, i_i = i_tc // NS, i_tc % NS
    t0 = i_t * BT
    r0 = t0 + i_i * BC
    r1 = r0 + BC - 1
    oc = tl.arange(0, BC)
    ri = r0 + oc
    ra = t0 + tl.arange(0, BT)
    lb = i_i * BC + oc
    la = tl.arange(0, BT)
    imask = (ri < T)[:, None]
    amask = (ra < T)[:, None]
    Gb = Gc + i_bh * Tp * K
    kb = k + (i_b * T * H + i_h) * K
    jm = (ra < r0)[:, None]
    im = (ra > r1)[:, None]
    mb = dM + i_bh * Tp * BT
    ck = tl.arange(0, K)
    G_i = tl.load(Gb + ri[:, None] * K + ck[None, :])
    G_a = tl.load(Gb + ra[:, None] * K + ck[None, :])
    g_r = tl.load(Gb + r0 * K + ck)
    g_r1 = tl.load(Gb + r1 * K + ck)
    k_i = tl.load(kb + ri[:, None] * (H * K) + ck[None, :], mask=imask, other=0.).to(tl.float32)
    k_a = tl.load(kb + ra[:, None] * (H * K) + ck[None, :], mask=amask, other=0.).to(tl.float32)
    e_i = tl.exp(G_i - g_r[None, :])
    e_c = tl.exp(g_r1[None, :] - G_i)
    k_r = tl.where(jm, k_a * tl.exp(tl.where(jm, g_r[None, :] - G_a, 0.)), 0.)
    e_a1 = tl.exp(tl.where(im, G_a - g_r1[None, :], 0.))
    k_c1 = tl.where(im, k_a * e_a1, 0.)
    # M: row role  dkr_i = sum_{j<i} dM_ij k_j exp(G_i - G_j);  column role  dkc_j = sum_{i>j} dM_ij k_i exp(G_i - G_j)
    dm_i = tl.load(mb + ri[:, None] * BT + la[None, :])
    dm_c = tl.load(mb + ra[:, None] * BT + lb[None, :])
    dkr = e_i * tl.dot(dm_i, k_r, input_precision=PREC)
    dkc = e_c * tl.dot(tl.trans(dm_c), k_c1, input_precision=PREC)
    for jj in range(BC):
        j = r0 + jj
        k_j = tl.load(kb + j * (H * K) + ck, mask=(ck * 0 + j) < T, other=0.).to(tl.float32)
        g_j = tl.load(Gb + j * K + ck)
        # exp(-|G_i - G_j|): exp(G_i - G_j) on rows i >= j, exp(G_j - G_i) on rows i <= j
        kx = k_j[None, :] * tl.exp(tl.where((ri >= j)[:, None], G_i - g_j[None, :], g_j[None, :] - G_i))
        dcol = tl.load(mb + ri * BT + (j - t0))                       # dM[i, j], i in the block (0 for i <= j)
        drow = tl.load(mb + j * BT + lb)                              # dM[j, i], i in the block (0 for i >= j)
        dkr += dcol[:, None] * kx
        dkc += drow[:, None] * kx
    dk_add = dkr + dkc
    dg_add = k_i * (dkr - dkc)
    for iq in range(NG):
        i_hq = i_h * NG + iq
        qb = q + (i_b * T * Hq + i_hq) * K
        pb = dP + (i_b * Hq + i_hq) * Tp * BT
        q_i = tl.load(qb + ri[:, None] * (Hq * K) + ck[None, :], mask=imask, other=0.).to(tl.float32)
        q_a = tl.load(qb + ra[:, None] * (Hq * K) + ck[None, :], mask=amask, other=0.).to(tl.float32)
        q_c1 = tl.where(im, q_a * e_a1, 0.)
        dp_i = tl.load(pb + ri[:, None] * BT + la[None, :])
        dp_c = tl.load(pb + ra[:, None] * BT + lb[None, :])
        dqb = e_i * tl.dot(dp_i, k_r, input_precision=PREC)
        dkb = e_c * tl.dot(tl.trans(dp_c), q_c1, input_precision=PREC)
        for jj in range(BC):
            j = r0 + jj
            k_j = tl.load(kb + j * (H * K) + ck, mask=(ck * 0 + j) < T, other=0.).to(tl.float32)
            q_j = tl.load(qb + j * (Hq * K) + ck, mask=(ck * 0 + j) < T, other=0.).to(tl.float32)
            g_j = tl.load(Gb + j * K + ck)
            ex = tl.exp(tl.where((ri >= j)[:, None], G_i - g_j[None, :], g_j[None, :] - G_i))
            dcol = tl.load(pb + ri * BT + (j - t0))                   # dP[i, j] (0 for i < j)
            drow = tl.load(pb + j * BT + lb)                          # dP[j, i] (0 for i > j)
            dqb += dcol[:, None] * k_j[None, :] * ex
            dkb += drow[:, None] * q_j[None, :] * ex
        dq_ptr = dq + ((i_b * T + ri[:, None]) * Hq + i_hq) * K + ck[None, :]
        tl.store(dq_ptr, tl.load(dq_ptr, mask=imask, other=0.) + dqb, mask=imask)
        dk_add += dkb
        dg_add += q_i * dqb - k_i * dkb
    dk_ptr = dk + ((i_b * T + ri[:, None]) * H + i_h) * K + ck[None, :]
    tl.store(dk_ptr, tl.load(dk_ptr, mask=imask, other=0.) + dk_add, mask=imask)
    dg_ptr = dG + (i_bh * Tp + ri[:, None]) * K + ck[None, :]
    tl.store(dg_ptr, tl.load(dg_ptr) + dg_add)


@triton.jit
def _rev_cumsum_kernel(dG, dg, T, Tp, H, K: tl.constexpr, BT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """dg_i = sum_{j >= i in the chunk} dG_j (G is the chunk-local cumulative sum of g)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_t * BT + tl.arange(0, BT)
    rmask = rows < T
    if PER_CHANNEL:
        ck = tl.arange(0, K)
        x = tl.load(dG + (i_bh * Tp + rows[:, None]) * K + ck[None, :])
        r = tl.sum(x, 0)[None, :] - tl.cumsum(x, axis=0) + x
        tl.store(dg + ((i_b * T + rows[:, None]) * H + i_h) * K + ck[None, :], r, mask=rmask[:, None])
    else:
        x = tl.load(dG + i_bh * Tp + rows)
        r = tl.sum(x, 0) - tl.cumsum(x, axis=0) + x
        tl.store(dg + (i_b * T + rows) * H + i_h, r, mask=rmask)


# ----------------------------------------------------------------------------------------------
# host functions
# ----------------------------------------------------------------------------------------------

def _kw(name):
    return dict(num_warps=WARPS.get(name, NUM_WARPS), num_stages=NUM_STAGES)


def _prec(dtype):
    return FP32_INPUT_DOT_PRECISION if dtype == torch.float32 else LOW_PRECISION_INPUT_DOT_PRECISION


def _fwd_core(q, k, v, g, beta, initial_state, per_channel, for_backward):
    """Everything up to the state pass. Returns a dict of intermediates."""
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    NG = Hq // H
    BT, BC = CHUNK, SUB_CHUNK
    BV = min(BLOCK_V, V)
    NT = triton.cdiv(T, BT)
    Tp = NT * BT
    dev = q.device
    f32 = torch.float32
    prec = _prec(q.dtype)
    Gc = torch.empty(B, H, Tp, *((K,) if per_channel else ()), device=dev, dtype=f32)
    _cumsum_kernel[(NT, B * H)](g, Gc, T, Tp, H, K=K, BT=BT, PER_CHANNEL=per_channel, **_kw("cumsum"))
    M = P = None
    if per_channel:
        M = torch.empty(B, H, Tp, BT, device=dev, dtype=f32)
        P = torch.empty(B, Hq, Tp, BT, device=dev, dtype=f32)
        _kda_intra_kernel[(NT * (BT // BC), 1 + NG, B * H)](q, k, Gc, M, P, T, Tp, H, NG, K=K, BT=BT, BC=BC,
                                                            BK=min(KDA_BK, K), PREC=prec, **_kw("kda_intra"))
    Tinv = torch.empty(B, H, Tp, BT, device=dev, dtype=f32) if for_backward else None
    W = torch.empty(B, H, Tp, K, device=dev, dtype=f32)
    U = torch.empty(B, H, Tp, V, device=dev, dtype=f32)
    Kd = torch.empty(B, H, Tp, K, device=dev, dtype=f32) if per_channel else W
    _solve_wy_kernel[(NT, B * H)](k, v, beta, Gc, M if M is not None else Gc, Tinv if Tinv is not None else W, W, U, Kd,
                                  T, Tp, H, K=K, V=V, BT=BT, BC=BC, BV=BV, PER_CHANNEL=per_channel,
                                  STORE_T=for_backward, PREC=prec, **_kw("solve_wy"))
    Hs = torch.empty(B, H, NT, K, V, device=dev, dtype=f32)
    Vp = torch.empty(B, H, Tp, V, device=dev, dtype=f32)
    hT = torch.empty(B, H, K, V, device=dev, dtype=f32)
    h0 = initial_state if initial_state is not None else hT
    _state_fwd_kernel[(V // BV, B * H)](k, Kd, Gc, W, U, Hs, Vp, h0, hT, T, Tp, NT, H, K=K, V=V, BT=BT, BV=BV,
                                        PER_CHANNEL=per_channel, HAS_H0=initial_state is not None,
                                        PREC=prec, **_kw("state_fwd"))
    return dict(Gc=Gc, M=M, P=P, Tinv=Tinv, W=W, Kd=Kd, Hs=Hs, Vp=Vp, hT=hT, NT=NT, Tp=Tp, BV=BV, prec=prec)


def chunk_fwd(q, k, v, g, beta, scale, initial_state, per_channel):
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    c = _fwd_core(q, k, v, g, beta, initial_state, per_channel, for_backward=False)
    o = torch.empty(B, T, Hq, V, device=q.device, dtype=v.dtype)
    BV, NT = min(BLOCK_V_OUT, V), c["NT"]
    _output_kernel[(V // BV, NT, B * Hq)](q, k, c["Gc"], c["P"] if per_channel else c["Gc"], c["Hs"], c["Vp"], o,
                                          scale, T, c["Tp"], NT, H, Hq // H, K=K, V=V, BT=CHUNK, BV=BV,
                                          PER_CHANNEL=per_channel, PREC=c["prec"],
                                          **_kw("output"))
    return o, c["hT"]


def chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dhT, per_channel):
    """Returns fp32 (dq, dk, dv in v's dtype, dg, dbeta, dh0)."""
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    NG = Hq // H
    BT, BC = CHUNK, SUB_CHUNK
    c = _fwd_core(q, k, v, g, beta, initial_state, per_channel, for_backward=True)
    BV, NT, Tp, prec = c["BV"], c["NT"], c["Tp"], c["prec"]
    dev, f32 = q.device, torch.float32
    Gc = c["Gc"]
    dVl = torch.empty(B, H, Tp, V, device=dev, dtype=f32)
    BVO = min(BLOCK_V_OUT, V)
    _dv_local_kernel[(V // BVO, NT, B * H)](q, k, Gc, c["P"] if per_channel else Gc, do, dVl, scale, T, Tp, H, NG,
                                           K=K, V=V, BT=BT, BV=BVO, PER_CHANNEL=per_channel, PREC=prec, **_kw("dv_local"))
    dHs = torch.empty(B, H, NT, K, V, device=dev, dtype=f32)
    dVp = torch.empty(B, H, Tp, V, device=dev, dtype=f32)
    dh0 = torch.empty(B, H, K, V, device=dev, dtype=f32)
    _state_bwd_kernel[(V // BV, B * H)](q, k, Gc, c["W"], dVl, do, dHs, dVp, dhT if dhT is not None else dh0, dh0,
                                        scale, T, Tp, NT, H, NG, K=K, V=V, BT=BT, BV=BV, PER_CHANNEL=per_channel,
                                        HAS_DHT=dhT is not None, PREC=prec, **_kw("state_bwd"))
    dq = torch.empty(B, T, Hq, K, device=dev, dtype=f32)
    dk = torch.empty(B, T, H, K, device=dev, dtype=f32)
    dW = torch.empty(B, H, Tp, K, device=dev, dtype=f32)
    dG = torch.empty(B, H, Tp, *((K,) if per_channel else ()), device=dev, dtype=f32)
    dP = torch.empty(B, Hq, Tp, BT, device=dev, dtype=f32) if per_channel else dG
    _bwd_dqk_kernel[(NT, B * H)](q, k, Gc, c["Hs"], dHs, c["Vp"], dVp, do, dq, dk, dW, dG, dP, scale, T, Tp, NT,
                                 H, NG, K=K, V=V, BT=BT, BV=BV, PER_CHANNEL=per_channel, PREC=prec, **_kw("bwd_dqk"))
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, H, device=dev, dtype=f32)
    dM = torch.empty(B, H, Tp, BT, device=dev, dtype=f32) if per_channel else dG
    _bwd_wy_kernel[(NT, B * H)](k, v, beta, Gc, c["M"] if per_channel else Gc, c["Tinv"], dW, dVp, dk, dv, dbeta,
                                dG, dM, T, Tp, H, K=K, V=V, BT=BT, BV=BV, PER_CHANNEL=per_channel,
                                PREC=prec, **_kw("bwd_wy"))
    if per_channel:
        _kda_intra_bwd_kernel[(NT * (BT // BC), B * H)](q, k, Gc, dP, dM, dq, dk, dG, T, Tp, H, NG, K=K, BT=BT,
                                                        BC=BC, PREC=prec, **_kw("kda_intra_bwd"))
    dg = torch.empty(g.shape, device=dev, dtype=f32)
    _rev_cumsum_kernel[(NT, B * H)](dG, dg, T, Tp, H, K=K, BT=BT, PER_CHANNEL=per_channel, **_kw("rev_cumsum"))
    return dq, dk, dv, dg, dbeta, dh0


class ChunkDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, per_channel):
        o, hT = chunk_fwd(q, k, v, g, beta, scale, initial_state, per_channel)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale = scale
        ctx.per_channel = per_channel
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        do = do.contiguous()
        if dhT is not None:
            dhT = dhT.contiguous()
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(q, k, v, g, beta, ctx.scale, initial_state, do, dhT, ctx.per_channel)
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), None,
                dh0.to(initial_state.dtype) if initial_state is not None else None, None)


_ALLOWED_DIMS = (16, 32, 64, 128)
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _validate(q, k, v, g, beta, initial_state, per_channel):
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [B, T, Hq, K], got shape {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k: expected 4 dims [B, T, H, K], got shape {tuple(k.shape)}")
    if v.dim() != 4:
        raise ValueError(f"v: expected 4 dims [B, T, H, V], got shape {tuple(v.shape)}")
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k: expected shape {(B, T, H, K)} (batch, time and key dim of q), got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v: expected shape {(B, T, H)} + (V,), got {tuple(v.shape)}")
    if H == 0 or Hq % H != 0:
        raise ValueError(f"q: head count {Hq} must be a multiple of k's head count {H}")
    if K not in _ALLOWED_DIMS:
        raise ValueError(f"k: key dim {K} not supported (one of {_ALLOWED_DIMS})")
    if V not in _ALLOWED_DIMS:
        raise ValueError(f"v: value dim {V} not supported (one of {_ALLOWED_DIMS})")
    gshape = (B, T, H, K) if per_channel else (B, T, H)
    if tuple(g.shape) != gshape:
        raise ValueError(f"g: expected shape {gshape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta: expected shape {(B, T, H)}, got {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"{name}: dtype {x.dtype} not supported (float32, bfloat16 or float16)")
        if x.device != q.device:
            raise ValueError(f"{name}: on {x.device}, expected {q.device} like q")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: dtypes ({k.dtype}, {v.dtype}) must equal q's dtype {q.dtype}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise ValueError("initial_state: expected a torch.Tensor or None")
        if tuple(initial_state.shape) != (B, H, K, V):
            raise ValueError(f"initial_state: expected shape {(B, H, K, V)}, got {tuple(initial_state.shape)}")
        if initial_state.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"initial_state: dtype {initial_state.dtype} not supported")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state: on {initial_state.device}, expected {q.device} like q")


def _triton_usable(device):
    import os
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def chunk_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     per_channel=False):
    """Chunked gated delta rule; the body of ``chunk_gated_delta_rule`` (per_channel=False, g [B, T, H]) and
    ``chunk_kda`` (per_channel=True, g [B, T, H, K]).

    q [B, T, Hq, K], k [B, T, H, K], v [B, T, H, V], beta [B, T, H], initial_state [B, H, K, V] or None.
    Returns (o [B, T, Hq, V] in v's dtype, final state [B, H, K, V] float32 or None). CUDA tensors run the
    Triton kernels (so do CPU tensors under TRITON_INTERPRET=1); other CPU tensors run the float64 chunked
    specification (differentiable through autograd). Raises ValueError naming the offending argument.
    """
    _validate(q, k, v, g, beta, initial_state, per_channel)
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    scale = float(scale)
    if not _triton_usable(q.device):
        # No GPU and no Triton interpreter: the float64 chunked specification (differentiable by autograd).
        from .reference import naive_chunk
        o, s = naive_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, per_channel=per_channel)
        return o, (s.float() if s is not None else None)
    if q.shape[1] == 0:
        B, _, Hq, _ = q.shape
        o = q.new_zeros(B, 0, Hq, v.shape[-1], dtype=v.dtype)
        if output_final_state:
            s = (initial_state.float().clone() if initial_state is not None
                 else q.new_zeros(B, k.shape[2], K, v.shape[-1], dtype=torch.float32))
            return o, s
        return o, None
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    o, hT = ChunkDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, per_channel)
    return o, (hT if output_final_state else None)
