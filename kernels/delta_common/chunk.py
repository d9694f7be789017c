"""Chunked gated delta rule: GDN (scalar decay, PER_CHANNEL=False) and KDA (per-channel decay,
PER_CHANNEL=True), forward and backward; the host side (launch constants, buffers, the launches, autograd,
argument checks) of the Triton kernels in chunk_fwd_kernels.py and chunk_bwd_kernels.py (their shared
precision helpers: chunk_common.py).

Math: shared/design/gated_delta_rule.md. Per chunk of BT rows with state S entering it, G = cumsum(g)
inside the chunk (fp32), and the decayed products (scalar decay: E_ij = exp(G_i - G_j); KDA: per channel)
    M_ij = sum_c k_ic k_jc E_ijc   (j < i)          A = diag(beta) M
    P_ij = sum_c q_ic k_jc E_ijc   (j <= i)
    T = (I + A)^-1,  W = T (beta exp(G) k),  U = T (beta v)
    V' = U - W S
    O = scale [ (q exp(G)) S + P V' ]     (KDA: QG S + scale P V', with QG = scale q exp(G))
    S <- exp(G_last) S + (k exp(G_last - G))^T V'
Only differences G_i - G_j with j <= i (and G_last - G_i) are ever exponentiated. For KDA the
per-channel products are formed per sub-chunk of BC rows against a reference row of G between i and j
(both factors then have non-positive exponents): the forward's off-diagonal BC x BC blocks about the first row of
the block row, and the pairs across the two halves of a diagonal block about its middle row; the pairs within a
group of KDA_DIAG_ROWS rows directly, exp(G_i - G_j) per pair and channel, elementwise (_kda_diag); in the
backward every pair j < i of the chunk by the binary hierarchy of the rows (levels 64, ..., 2: i in the second, j
in the first half of a row group, decayed through the group's middle row m as exp(G_i - G_m) exp(G_m - G_j)), one
exp per row and channel per level, the pair sums as masked tl.dots.

Kernel plan (grid in brackets; "bh" = batch * kv heads, "bhq" = batch * query heads, NS = BT / BC):
  forward:  _cumsum [NT, bh] -> (KDA) _kda_diag [Tp, NG, B * H/KDA_DIAG_BH] (one program per row and block of
            kv heads: the pairs within its group of KDA_DIAG_ROWS rows, no tl.dot, and the row's decayed queries
            QG = scale q exp(G) [B, Hq, Tp, K]) and _kda_intra [NT * NS, NG, bh] (one program per sub-chunk: the
            rest of its rows of M and P up to the diagonal block, sharing the exps; right of it M and P are left
            unwritten and their readers mask j > i)
            -> _solve_wy [NT, bh] (T, W, U; KDA also k exp(G_last - G))
            -> _state_fwd [V/BV, bh] (sequential over chunks) -> _output [V/BV, NT, bhq] (KDA reads QG rather than
            q and G: no [BT, K] exps once per value block)
  backward: the forward intermediates it needs: G (KDA also M, P, QG), T^-1, W (KDA also Kd), the chunk states Hs
            and V'. Under autograd the forward keeps them (stores T^-1: STORE_T) and the backward runs none of the
            forward kernels (KEEP_FORWARD_FOR_BACKWARD; KEEP_CHUNK_STATES_FOR_BACKWARD off keeps U instead of Hs, V'
            and re-runs _state_fwd; KDA_KEEP_INTRA_FOR_BACKWARD for G, M, P, QG); with the switches off it
            recomputes them (_fwd_core runs each forward kernel whose outputs were not kept). Inference stores none
            of them beyond the output's needs. Then _dv_local [V/BV, NT, bh]
            -> _state_bwd [V/STATE_BWD_BV, bh] (reverse over chunks; reads KDA's decayed products Kd and QG, so its
            sequential loop takes no per-channel exps) -> _bwd_dqk [NT, bh] -> _bwd_wy [NT, bh] -> (KDA)
            _kda_intra_bwd [NS * K/BK, NT, bh] (one program per sub-chunk and key block, launched once per query
            head of the group) -> _rev_cumsum [NT, bh] (dg from dG)
The chunk kernels with a key-dimension loop (_kda_intra, _solve_wy's W, _bwd_wy) take K in blocks (KDA_BK,
WY_BK, BWD_WY_BK) to keep their register tiles small; the forward KDA sub-chunk kernel forms its row factors once
per key block of KDA_BK channels and takes every block of its rows in that one pass over K ([BC, KDA_BK] tiles and
up to eight [BC, BC] accumulators at one warp: a 16 x 16 tl.dot is one warp's mma tile). The backward one,
_kda_intra_bwd, takes one sub-chunk of BC rows and one key block of KDA_BWD_BK channels per program (142
registers, no spills at 4 warps with TF32 products; offline sm_90 compile, triton 3.9), so each of its dq, dk,
dG entries is added to once per query head. _bwd_dqk keeps whole [BT, K] tiles (its V-reductions dV' S^T,
V' dS'^T, dO S^T and dO V'^T accumulate over V blocks of BV in one pass, each input tile loaded once, dO V'^T
formed once rather than once per key block); at 8 warps, one query head per kv head, its bf16 path does not spill
registers, TF32 spills 8 bytes for KDA, and its fp32 "ieee" path spills, as it did with key blocks.
Intermediates live in padded buffers [B, H, NT*BT, ...]; padded rows have k = v = q = beta = 0 and g = 0,
which makes them exact no-ops.

Precision (PREC of the products; _precisions):
  fp32 inputs: every intermediate fp32, exact ("ieee") products.
  bf16 inputs with LOW_PRECISION_INTERMEDIATES (default): the buffers in BF16_BUFFERS (W, U, Kd, the chunk
    states Hs, V', KDA's QG and P, and dHs, dV') are stored in bf16 and the kernels in BF16_DOT_KERNELS feed their
    products bf16 operands with fp32 accumulation (PREC "bf16"), as flash-linear-attention does; the state carried
    across chunks, G, M, T's block merges, the gradient accumulators and the final state stay fp32, and
    KDA's decayed sub-chunk products and T's block merges use TF32 (PREC_HI). Under the CPU interpreter, whose
    bf16 tl.dot is unusable, "bf16emu" reproduces the same roundings with exact fp32 products.
  fp16 inputs (and bf16 with the switch off): fp32 intermediates and TF32 products.
Block sizes and warps are chosen so that the forward kernels do not spill registers at K = V = 128 on sm_90
(but KDA's _solve_wy at 1 warp: 112 bytes spilled, 216 with STORE_T, when compiled at 3 stages, WY_BK 32, triton 3.9).

_solve_wy: GDN forms the 10 lower blocks k_I k_J^T of M itself (K in blocks of WY_BK, key tiles as loaded, bf16
operands on the bf16 path), the off-diagonal decays factored about each block row's first row (vectors of exps,
no [BC, BC] ones); the diagonal blocks enter the forward substitution transposed (no layout conversion per
step); the column factors of W and U are folded into T's blocks (W = (T diag(beta exp(G))) k, U = (T diag(beta)) v;
KDA: W = (T diag(beta)) (exp(G) k)), so their key and value tiles enter the products as loaded.
KDA takes each [BC, WY_BK] block of k and G once for both exp(G) k (W) and Kd = k exp(G_last - G).

Grouped query heads: q has Hq = NG * H heads; query head hq reads kv head hq // NG.

The launch constants below are read when a kernel is launched, so assigning them on this module (e.g.
``chunk.CHUNK``, ``chunk.WARPS``) takes effect on the next call.
"""
from __future__ import annotations

import torch
import triton

from ..device import multiprocessors
from .chunk_bwd_kernels import (_bwd_dqk_kernel, _bwd_wy_kernel, _dv_local_kernel, _kda_intra_bwd_kernel,
                                _rev_cumsum_kernel, _state_bwd_kernel)
from .chunk_fwd_kernels import (_cumsum_kernel, _kda_diag_kernel, _kda_intra_kernel, _output_kernel, _solve_wy_kernel,
                                _state_fwd_kernel)

# Tunable launch constants (Hopper defaults). "measured: <date> — <title>" names the entry of BENCHMARKS.md, History >
# Linear-attention kernels, that holds the figures behind a value; the tuning history itself is in git.
CHUNK = 64          # BT: rows per chunk (tl.dot blocks of 64)
SUB_CHUNK = 16      # BC: KDA sub-chunk for the per-channel decayed products
BLOCK_V = 32        # BV: value-dimension block of _solve_wy's U, of _state_fwd and of the backward chunk kernels
# _state_fwd's value block while V / STATE_FWD_WIDE_BV x B x H programs still give every SM one (else BLOCK_V);
# measured: 2026-11-30 — A wider state pass when the SMs stay filled
STATE_FWD_WIDE_BV = 64
STATE_BWD_BV = 32   # value-dimension block of _state_bwd on the bf16 path (V / STATE_BWD_BV programs per kv head)
STATE_BWD_FP32_BV = 16  # the same with fp32 intermediates: at 32 the TF32 kernel asks more shared memory than sm_90
                        # has at 2 stages (233472 of 232448 bytes) and the exact one spills (offline, triton 3.9)
# shared memory that _state_bwd's pipelined loads may take (all stages): sm_90's 232448 bytes per block less ~32 KB
# that its products and layout conversions use besides (measured 16-29 KB, offline compiles, triton 3.9)
STATE_BWD_STAGE_SMEM = 200 * 1024
BLOCK_V_OUT = 64    # value-dimension block of GDN's _output and of _dv_local (each V block recomputes GDN's P; GDN's
                    # _output: 168 registers at 4 warps, K = V = 128, offline sm_90 compile, triton 3.9)
BLOCK_V_OUT_KDA = 128  # KDA's _output: QG and P load once per chunk (128 registers at 4 warps, no spills); measured:
                       # 2026-11-30 — KDA decayed queries stored once, `_output` on whole value rows
KDA_BK = 16         # key-dimension block of _kda_intra (176 registers at 1 warp, no spills); measured: 2026-11-30 —
                    # KDA decayed queries stored once, `_output` on whole value rows
KDA_DIAG_ROWS = 8   # rows per group of _kda_diag: 16 (= SUB_CHUNK) or 8 (then _kda_intra takes the pairs across the
                    # diagonal block's halves); measured: 2026-11-30 — A token-parallel KDA diagonal kernel
KDA_DIAG_BH = 4     # kv heads per _kda_diag program (with 2 warps: WARPS); measured: 2026-11-30 — A token-parallel
                    # KDA diagonal kernel
KDA_INTRA_IEEE_WARPS = 2  # _kda_intra's warps with exact fp32 ("ieee") products (FMA tl.dots): 198 registers, no
                          # spills (offline sm_90 compile, triton 3.9)
WY_BK = 32          # key-dimension block of _solve_wy's W = T (beta exp(G) k) and of GDN's M = K K^T there
BWD_WY_BK = 32      # key-dimension block of _bwd_wy
KDA_BWD_BK = 32     # key-dimension block of _kda_intra_bwd (one per program; spills at 64 with 4 warps); measured:
                    # 2026-11-30 — Four branches merged, a `_bwd_dqk` race fixed
KDA_BWD_IEEE_BK = 16  # the same for exact fp32 ("ieee") products (137 registers at 4 warps; 182 at 32, no spills)
# KDA with autograd: keep G, the sub-chunk products M, P and the decayed queries QG from the forward for the backward
# (bf16, K = 128, one query head per kv head: 1152 bytes per token and head; 604 MB at B=1 T=16384 H=32)
KDA_KEEP_INTRA_FOR_BACKWARD = True
# With autograd: keep the forward's T^-1, W, Kd, chunk states Hs and V' for the backward, which then runs neither
# _solve_wy nor _state_fwd; measured: 2026-11-30 — Four branches merged, a `_bwd_dqk` race fixed
KEEP_FORWARD_FOR_BACKWARD = True
# with KEEP_FORWARD_FOR_BACKWARD: False keeps U (2 V bytes) in place of Hs and V' (the largest, 2 K V / BT + 2 V) and
# re-runs _state_fwd in the backward: GDN 772, KDA 1024 bytes per token and head at K = V = 128 (405 MB, 537 MB).
KEEP_CHUNK_STATES_FOR_BACKWARD = True
NUM_WARPS = 4
NUM_STAGES = 2
# Warps per kernel ("<name>_kda" overrides "<name>" for KDA); measured: 2026-11-30 — Chunk kernels: GPU tests,
# per-kernel profile, launch tuning, and the later entries, whose sweeps name each setting (WARPS.<name>)
WARPS = {"cumsum": 4, "kda_diag": 2, "kda_intra": 1, "solve_wy": 1, "solve_wy_kda": 1, "state_fwd": 4, "output": 4,
         "dv_local": 8, "state_bwd": 8, "bwd_dqk": 8, "bwd_wy": 4, "bwd_wy_kda": 4, "kda_intra_bwd": 4, "rev_cumsum": 4}
# Pipelining stages per kernel (same override; NUM_STAGES where absent). bwd_dqk and bwd_wy_kda run unpipelined: at 2
# stages the one gave run-to-run different dq, the other faulted at 4 warps; measured: as for WARPS
STAGES: dict[str, int] = {"solve_wy": 3, "solve_wy_kda": 2, "state_fwd": 3, "bwd_dqk": 1, "kda_intra": 3,
                          "bwd_wy_kda": 1}
# Kernels that keep >= 8 warps on value blocks narrower than the given width (4 warps failed at V = 16); measured:
# 2026-11-30 — Tuned defaults measured, a GDN `_output` crash bisected, the WY split tried (output); bwd_wy: as WARPS
FEW_WARPS_MIN_BV = {"output": 64, "bwd_wy": 32}
# tl.dot input precision for float32 operands: inputs in float32 use exact ("ieee") products;
# for bf16/fp16 inputs the fp32 intermediates go through TF32 tensor cores.
FP32_INPUT_DOT_PRECISION = "ieee"
LOW_PRECISION_INPUT_DOT_PRECISION = "tf32"
# bf16 inputs: BF16_BUFFERS stored in bf16, BF16_DOT_KERNELS on bf16 operands with fp32 accumulation, as
# flash-linear-attention does (module docstring: Precision). False: fp32 intermediates, TF32 products.
LOW_PRECISION_INTERMEDIATES = True
# with LOW_PRECISION_INTERMEDIATES: the kernels whose products take bf16 operands (the others use PREC_HI) and
# the intermediates stored in bf16 (the others fp32)
BF16_DOT_KERNELS = {"solve_wy", "state_fwd", "output", "dv_local", "state_bwd", "bwd_dqk", "bwd_wy"}
BF16_BUFFERS = {"W", "U", "Kd", "Hs", "Vp", "dHs", "dVp", "QG", "P"}


def _kw(name, per_channel):
    """Launch keywords (num_warps, num_stages) of kernel `name` from WARPS / STAGES; for KDA (per_channel) a
    "<name>_kda" entry overrides "<name>". per_channel has no default: a launch that omitted it would silently
    ignore its KDA entries (as seven shared kernels did before 4ce4493)."""
    def pick(table, default):
        value = table.get(name + "_kda") if per_channel else None
        return value or table.get(name, default)
    return dict(num_warps=pick(WARPS, NUM_WARPS), num_stages=pick(STAGES, NUM_STAGES))


def _state_bwd_kw(per_channel, NG, K, BT, BV, in_bytes, buf_bytes):
    """_kw("state_bwd") with its stages capped to fit STATE_BWD_STAGE_SMEM: each stage holds the chunk's W and Kd
    (KDA) or k (GDN) [BT, K] tiles and per query head a [BT, K] QG (KDA) or q (GDN) and a [BT, BV] dO, so
    grouped query heads (NG = 4 on the bf16 path, 2 with fp32 intermediates) leave room for one stage only."""
    kw = _kw("state_bwd", per_channel)
    k_bytes, q_bytes = (buf_bytes, buf_bytes) if per_channel else (in_bytes, in_bytes)
    stage = BT * K * (buf_bytes + k_bytes + NG * q_bytes) + NG * BT * BV * in_bytes
    kw["num_stages"] = max(1, min(kw["num_stages"], STATE_BWD_STAGE_SMEM // stage))
    return kw


def _value_block_kw(name, per_channel, block_v):
    """_kw(name) with at least 8 warps when the kernel's value block is narrower than FEW_WARPS_MIN_BV[name]."""
    kw = _kw(name, per_channel)
    if block_v < FEW_WARPS_MIN_BV.get(name, 0):
        kw["num_warps"] = max(kw["num_warps"], 8)
    return kw


def _state_fwd_bv(V, programs_per_value_block, device):
    """_state_fwd's value block: STATE_FWD_WIDE_BV when V / STATE_FWD_WIDE_BV x programs_per_value_block (B x H)
    programs fill the device's SMs, else BLOCK_V (and BLOCK_V off CUDA)."""
    wide = min(STATE_FWD_WIDE_BV, V)
    sms = multiprocessors(device)
    if sms is not None and wide > BLOCK_V and (V // wide) * programs_per_value_block >= sms:
        return wide
    return min(BLOCK_V, V)


def _precisions(x):
    """(PREC, PREC_HI, intermediate dtype) for inputs like x. fp32: exact products, fp32 intermediates.
    bf16 with LOW_PRECISION_INTERMEDIATES: bf16 tensor-core products and bf16 W, U, Kd, QG, Hs, V', dHs, dV'
    ("bf16emu" under the CPU interpreter, whose bf16 tl.dot is unusable: the same roundings, exact fp32 products).
    Otherwise (fp16, or the switch off): fp32 intermediates and TF32 products. PREC_HI (the T block merges and
    KDA's decayed sub-chunk products) is never bf16."""
    if x.dtype == torch.float32:
        return FP32_INPUT_DOT_PRECISION, FP32_INPUT_DOT_PRECISION, torch.float32
    if x.dtype == torch.bfloat16 and LOW_PRECISION_INTERMEDIATES:
        return ("bf16" if x.is_cuda else "bf16emu"), LOW_PRECISION_INPUT_DOT_PRECISION, torch.bfloat16
    return LOW_PRECISION_INPUT_DOT_PRECISION, LOW_PRECISION_INPUT_DOT_PRECISION, torch.float32


def _kept_for_backward(per_channel):
    """Names of the forward intermediates that the autograd forward keeps for the backward (the KEEP switches)."""
    names = []
    if per_channel and KDA_KEEP_INTRA_FOR_BACKWARD:
        names += ["Gc", "M", "P", "QG"]
    if KEEP_FORWARD_FOR_BACKWARD:
        if not per_channel:
            names.append("Gc")
        names += ["Tinv", "W"] + (["Kd"] if per_channel else [])
        names += ["Hs", "Vp"] if KEEP_CHUNK_STATES_FOR_BACKWARD else ["U"]
    return tuple(names)


def _fwd_core(q, k, v, g, beta, scale, initial_state, per_channel, store_t, kept=None):
    """Everything up to the state pass. Returns a dict of intermediates. store_t: also store T^-1 (the backward
    needs it). kept: intermediates already computed by the forward (names of _kept_for_backward); the kernels
    whose outputs are all there are skipped (the KDA sub-chunk kernels when G, M, P, QG are kept, _solve_wy when W
    and T^-1 are, _state_fwd when Hs and V' are)."""
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    NG = Hq // H
    BT, BC = CHUNK, SUB_CHUNK
    BV = min(BLOCK_V, V)
    NT = triton.cdiv(T, BT)
    Tp = NT * BT
    dev = q.device
    f32 = torch.float32
    prec, prec_hi, idt = _precisions(q)
    low = prec in ("bf16", "bf16emu")
    kept = kept or {}

    def p(kernel):
        return prec if not low or kernel in BF16_DOT_KERNELS else prec_hi

    def dt(buffer):
        return idt if buffer in BF16_BUFFERS else f32

    c = dict(p=p, dt=dt, low=low, NT=NT, Tp=Tp, BV=BV, prec_hi=prec_hi)
    Gc, M, P, QG = kept.get("Gc"), kept.get("M"), kept.get("P"), kept.get("QG")
    if Gc is None:
        Gc = torch.empty(B, H, Tp, *((K,) if per_channel else ()), device=dev, dtype=f32)
        _cumsum_kernel[(NT, B * H)](g, Gc, T, Tp, H, K=K, BT=BT, PER_CHANNEL=per_channel, **_kw("cumsum", per_channel))
    if per_channel and M is None:
        M = torch.empty(B, H, Tp, BT, device=dev, dtype=f32)
        P = torch.empty(B, Hq, Tp, BT, device=dev, dtype=dt("P"))
        QG = torch.empty(B, Hq, Tp, K, device=dev, dtype=dt("QG"))
        kw = _kw("kda_intra", per_channel)
        if prec_hi == "ieee":
            kw["num_warps"] = max(kw["num_warps"], KDA_INTRA_IEEE_WARPS)
        # QG and P are stored at the precision of _output's products (QG's other reader, _state_bwd, shares it)
        _kda_diag_kernel[(Tp, NG, B * triton.cdiv(H, KDA_DIAG_BH))](q, k, Gc, M, P, QG, scale, T, Tp, H, NG, K=K,
                                                                   BT=BT, BC=BC, DR=KDA_DIAG_ROWS, BH=KDA_DIAG_BH,
                                                                   OUT_PREC=p("output"), **_kw("kda_diag", per_channel))
        _kda_intra_kernel[(NT * (BT // BC), NG, B * H)](q, k, Gc, M, P, T, Tp, H, NG, K=K, BT=BT, BC=BC,
                                                        BK=min(KDA_BK, K), DR=KDA_DIAG_ROWS, PREC=prec_hi,
                                                        OUT_PREC=p("output"), **kw)
    c.update(Gc=Gc, M=M, P=P, QG=QG)
    if "W" in kept:
        W, U, Tinv = kept["W"], kept.get("U"), kept["Tinv"]
        Kd = kept["Kd"] if per_channel else W
    else:
        Tinv = torch.empty(B, H, Tp, BT, device=dev, dtype=f32) if store_t else None
        W = torch.empty(B, H, Tp, K, device=dev, dtype=dt("W"))
        U = torch.empty(B, H, Tp, V, device=dev, dtype=dt("U"))
        Kd = torch.empty(B, H, Tp, K, device=dev, dtype=dt("Kd")) if per_channel else W
        _solve_wy_kernel[(NT, B * H)](k, v, beta, Gc, M if M is not None else Gc, Tinv if Tinv is not None else W, W,
                                      U, Kd, T, Tp, H, K=K, V=V, BT=BT, BC=BC, BV=BV, PER_CHANNEL=per_channel,
                                      STORE_T=store_t, PREC=p("solve_wy"), PREC_HI=prec_hi, BKW=min(WY_BK, K),
                                      **_kw("solve_wy", per_channel))
    c.update(Tinv=Tinv, W=W, U=U, Kd=Kd)
    if "Hs" in kept:
        c.update(Hs=kept["Hs"], Vp=kept["Vp"], hT=None)
        return c
    if U is None:
        raise RuntimeError("_fwd_core: W kept without U or the chunk states (see _kept_for_backward)")
    Hs = torch.empty(B, H, NT, K, V, device=dev, dtype=dt("Hs"))
    Vp = torch.empty(B, H, Tp, V, device=dev, dtype=dt("Vp"))
    hT = torch.empty(B, H, K, V, device=dev, dtype=f32)
    h0 = initial_state if initial_state is not None else hT
    BVS = _state_fwd_bv(V, B * H, dev)
    _state_fwd_kernel[(V // BVS, B * H)](k, Kd, Gc, W, U, Hs, Vp, h0, hT, T, Tp, NT, H, K=K, V=V, BT=BT, BV=BVS,
                                         PER_CHANNEL=per_channel, HAS_H0=initial_state is not None,
                                         PREC=p("state_fwd"), **_kw("state_fwd", per_channel))
    c.update(Hs=Hs, Vp=Vp, hT=hT)
    return c


def chunk_fwd(q, k, v, g, beta, scale, initial_state, per_channel, keep=()):
    """Returns (o, final state, kept): kept maps the names in keep (see _kept_for_backward) to the intermediates
    for chunk_bwd. With keep empty (inference) nothing beyond the output's needs is stored (no T^-1)."""
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    c = _fwd_core(q, k, v, g, beta, scale, initial_state, per_channel, store_t="Tinv" in keep)
    o = torch.empty(B, T, Hq, V, device=q.device, dtype=v.dtype)
    BV, NT = min(BLOCK_V_OUT_KDA if per_channel else BLOCK_V_OUT, V), c["NT"]
    QG, P = (c["QG"], c["P"]) if per_channel else (q, c["Gc"])     # GDN reads neither
    _output_kernel[(V // BV, NT, B * Hq)](q, k, c["Gc"], QG, P, c["Hs"], c["Vp"], o, scale, T, c["Tp"], NT, H,
                                          Hq // H, K=K, V=V, BT=CHUNK, BV=BV, PER_CHANNEL=per_channel,
                                          PREC=c["p"]("output"), **_value_block_kw("output", per_channel, BV))
    return o, c["hT"], {name: c[name] for name in keep}


def chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dhT, per_channel, kept=None):
    """Returns fp32 (dq, dk, dv in v's dtype, dg, dbeta, dh0). kept: the intermediates chunk_fwd kept (by name);
    the missing ones are recomputed."""
    B, T, Hq, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    NG = Hq // H
    BT, BC = CHUNK, SUB_CHUNK
    c = _fwd_core(q, k, v, g, beta, scale, initial_state, per_channel, store_t=True, kept=kept)
    BV, NT, Tp = c["BV"], c["NT"], c["Tp"]
    dev, f32 = q.device, torch.float32
    Gc = c["Gc"]
    dVl = torch.empty(B, H, Tp, V, device=dev, dtype=f32)
    BVO = min(BLOCK_V_OUT, V)
    _dv_local_kernel[(V // BVO, NT, B * H)](q, k, Gc, c["P"] if per_channel else Gc, do, dVl, scale, T, Tp, H, NG,
                                           K=K, V=V, BT=BT, BV=BVO, PER_CHANNEL=per_channel, PREC=c["p"]("dv_local"),
                                           **_kw("dv_local", per_channel))
    dHs = torch.empty(B, H, NT, K, V, device=dev, dtype=c["dt"]("dHs"))
    dVp = torch.empty(B, H, Tp, V, device=dev, dtype=c["dt"]("dVp"))
    dh0 = torch.empty(B, H, K, V, device=dev, dtype=f32)
    BVS = min(STATE_BWD_BV if c["low"] else STATE_BWD_FP32_BV, V)
    _state_bwd_kernel[(V // BVS, B * H)](q, c["QG"] if per_channel else q, k, c["Kd"], Gc, c["W"], dVl, do, dHs, dVp,
                                         dhT if dhT is not None else dh0, dh0, scale, T, Tp, NT, H, K=K, V=V, BT=BT,
                                         BV=BVS, NG=NG, PER_CHANNEL=per_channel, HAS_DHT=dhT is not None,
                                         PREC=c["p"]("state_bwd"),
                                         **_state_bwd_kw(per_channel, NG, K, BT, BVS, q.element_size(),
                                                         c["W"].element_size()))
    dq = torch.empty(B, T, Hq, K, device=dev, dtype=f32)
    dk = torch.empty(B, T, H, K, device=dev, dtype=f32)
    dW = torch.empty(B, H, Tp, K, device=dev, dtype=f32)
    dG = torch.empty(B, H, Tp, *((K,) if per_channel else ()), device=dev, dtype=f32)
    dP = torch.empty(B, Hq, Tp, BT, device=dev, dtype=f32) if per_channel else dG
    _bwd_dqk_kernel[(NT, B * H)](q, k, Gc, c["Hs"], dHs, c["Vp"], dVp, do, dq, dk, dW, dG, dP, scale, T, Tp, NT, H,
                                 NG, K=K, V=V, BT=BT, BV=BV, PER_CHANNEL=per_channel, GROUPED=NG > 1,
                                 PREC=c["p"]("bwd_dqk"), **_kw("bwd_dqk", per_channel))
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, H, device=dev, dtype=f32)
    dM = torch.empty(B, H, Tp, BT, device=dev, dtype=f32) if per_channel else dG
    _bwd_wy_kernel[(NT, B * H)](k, v, beta, Gc, c["M"] if per_channel else Gc, c["Tinv"], dW, dVp, dk, dv, dbeta,
                                dG, dM, T, Tp, H, K=K, V=V, BT=BT, BV=BV, BK=min(BWD_WY_BK, K), PER_CHANNEL=per_channel,
                                PREC=c["p"]("bwd_wy"), **_value_block_kw("bwd_wy", per_channel, BV))
    if per_channel:
        BKI = min(KDA_BWD_IEEE_BK if c["prec_hi"] == "ieee" else KDA_BWD_BK, K)
        for iq in range(NG):
            _kda_intra_bwd_kernel[(BT // BC * (K // BKI), NT, B * H)](q, k, Gc, dP, dM, dq, dk, dG, T, Tp, H, NG, iq,
                                                                      K=K, BT=BT, BC=BC, BK=BKI, WITH_M=iq == 0,
                                                                      PREC=c["prec_hi"],
                                                                      **_kw("kda_intra_bwd", per_channel))
    dg = torch.empty(g.shape, device=dev, dtype=f32)
    _rev_cumsum_kernel[(NT, B * H)](dG, dg, T, Tp, H, K=K, BT=BT, PER_CHANNEL=per_channel,
                                    **_kw("rev_cumsum", per_channel))
    return dq, dk, dv, dg, dbeta, dh0


class ChunkDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, per_channel, keep):
        o, hT, kept = chunk_fwd(q, k, v, g, beta, scale, initial_state, per_channel, keep=keep)
        ctx.kept_names = tuple(kept)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *kept.values())
        ctx.scale = scale
        ctx.per_channel = per_channel
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        q, k, v, g, beta, initial_state, *kept = ctx.saved_tensors
        do = do.contiguous()
        if dhT is not None:
            dhT = dhT.contiguous()
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(q, k, v, g, beta, ctx.scale, initial_state, do, dhT, ctx.per_channel,
                                               kept=dict(zip(ctx.kept_names, kept)))
        return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), None,
                dh0.to(initial_state.dtype) if initial_state is not None else None, None, None)


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


def chunk_delta_rule_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            per_channel=False):
    """Chunked gated delta rule on the Triton kernels; the Triton path of ``chunk_gated_delta_rule``
    (per_channel=False, g [B, T, H]) and ``chunk_kda`` (per_channel=True, g [B, T, H, K]).

    q [B, T, Hq, K], k [B, T, H, K], v [B, T, H, V], beta [B, T, H], initial_state [B, H, K, V] or None.
    Returns (o [B, T, Hq, V] in v's dtype, final state [B, H, K, V] float32 or None). CUDA tensors, or CPU
    tensors under TRITON_INTERPRET=1. Raises ValueError naming the offending argument.
    """
    _validate(q, k, v, g, beta, initial_state, per_channel)
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    scale = float(scale)
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
    needs_backward = torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                                     for x in (q, k, v, g, beta, initial_state))
    keep = _kept_for_backward(per_channel) if needs_backward else ()
    o, hT = ChunkDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, per_channel, keep)
    return o, (hT if output_final_state else None)
