"""Chunked GDN / KDA Triton kernels against the pure-PyTorch references.

On the CPU the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1) in float32:
outputs, final states and every gradient (q, k, v, g, beta, initial_state) must match the float64
recurrent reference (differentiated by torch.autograd) to a relative RMS error of 1e-4.
The bf16 cases are marked ``gpu`` and run on a CUDA device (o / states <= 5e-3, gradients <= 2e-2).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _testing import nan_poisoned_allocations, rel_rms
from retrofit.kernels.delta_common import chunk as chunk_module
from retrofit.kernels.delta_common.chunk_bwd_kernels import _bwd_wy_kernel
from retrofit.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from retrofit.kernels.kda import chunk_kda, naive_chunk_kda, naive_recurrent_kda

OPS = {
    "gdn": (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, naive_chunk_gated_delta_rule),
    "kda": (chunk_kda, naive_recurrent_kda, naive_chunk_kda),
}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# fp32 inputs, exact fp32 products under the interpreter: measured errors are ~1e-6 (chunked vs token-by-token
# summation order); 1e-4 is the bound and leaves room for T = 130 accumulations without hiding a wrong term
# (a missing decay or gradient term gives errors of 1e-2 or more).
FP32_TOL = 1e-4
# bf16 inputs on the GPU (products of bf16 operands with fp32 accumulation, bf16 intermediates W, U, states, V',
# bf16 outputs: chunk.py's LOW_PRECISION_INTERMEDIATES path, flash-linear-attention's scheme); the same roundings
# under the interpreter ("bf16emu") land at 2e-3 to 3.5e-3 for o, states and gradients (test_bf16_inputs_on_cpu).
# The bounds are the ones flash-linear-attention's tests accept for bf16 (5e-3 outputs, 2e-2 dg / dbeta).
BF16_TOL_OUT, BF16_TOL_GRAD = 5e-3, 2e-2


def make_inputs(kind, B, T, H, K, V, *, groups=1, h0=True, gmin=-1.0, dtype=torch.float32, gate_dtype=None,
                device="cpu", seed=0):
    """q [B,T,groups*H,K], L2-normalised k, v, log decay g in [gmin, 0], beta in (0,1), optional state; q, k, v in
    dtype, g and beta in gate_dtype (default: dtype)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = rnd(B, T, groups * H, K)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, H, V)
    gshape = (B, T, H, K) if kind == "kda" else (B, T, H)
    g = gmin * torch.rand(*gshape, generator=gen)
    beta = torch.sigmoid(rnd(B, T, H))
    s0 = rnd(B, H, K, V) if h0 else None
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
    out += [x.to(device=device, dtype=gate_dtype or dtype) for x in (g, beta)]
    out.append(s0.to(device) if s0 is not None else None)          # states stay float32
    return out


def run_with_grads(fn, inputs, do, dht, *, to=None):
    """Calls fn with output_final_state=True; returns (o, final state, grads) for loss <o,do> + <S_T,dht>."""
    leaves = [None if x is None else (x.to(to) if to is not None else x.clone()).requires_grad_() for x in inputs]
    q, k, v, g, beta, s0 = leaves
    o, st = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    loss = (o.to(do.dtype) * do).sum() + (st.to(dht.dtype) * dht).sum()
    loss.backward()
    grads = [None if x is None else x.grad for x in leaves]
    return o.detach(), st.detach(), grads


def check_against_reference(kind, inputs, tol_o, tol_g, poison=True):
    chunk, naive, _ = OPS[kind]
    B, T, Hq, K = inputs[0].shape
    H, V = inputs[1].shape[2], inputs[2].shape[-1]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, Hq, V, generator=gen).to(inputs[0].device)
    dht = torch.randn(B, H, K, V, generator=gen).to(inputs[0].device)
    if poison:
        with nan_poisoned_allocations():
            o, st, grads = run_with_grads(chunk, inputs, do, dht)
    else:
        o, st, grads = run_with_grads(chunk, inputs, do, dht)
    o_ref, st_ref, grads_ref = run_with_grads(naive, inputs, do.double(), dht.double(), to=torch.float64)
    assert o.shape == o_ref.shape and o.dtype == inputs[2].dtype
    assert st.dtype == torch.float32 and st.shape == (B, H, K, V)
    errs = {"o": rel_rms(o, o_ref), "final_state": rel_rms(st, st_ref)}
    for name, gr, gr_ref, x in zip(NAMES, grads, grads_ref, inputs):
        if x is None:
            continue
        assert gr is not None and gr.shape == x.shape and gr.dtype == x.dtype, name
        assert torch.isfinite(gr).all(), f"d{name} not finite"
        errs["d" + name] = rel_rms(gr, gr_ref)
    assert torch.isfinite(o).all() and torch.isfinite(st).all()
    bad = {n: e for n, e in errs.items() if e > (tol_o if n in ("o", "final_state") else tol_g)}
    assert not bad, f"relative RMS errors over tolerance: {bad} (all: {errs})"
    return errs


# (T, H, groups, K, V, initial_state): every listed T, H, (K, V) and flag appears; grouped query heads (Hq = 3 H)
CPU_CASES = [
    (1, 1, 1, 16, 16, False),
    (1, 3, 1, 32, 16, True),
    (63, 3, 1, 16, 16, True),
    (63, 1, 1, 64, 64, False),
    (75, 1, 1, 32, 16, False),
    (75, 3, 1, 64, 64, True),
    (130, 1, 1, 16, 16, True),
    (130, 1, 1, 32, 16, False),
    (75, 1, 3, 16, 16, True),      # GQA
    (63, 1, 3, 32, 16, False),     # GQA
    (75, 1, 2, 128, 32, True),     # K = 128: the key-blocked kernels run four key blocks of 32; GQA
]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T,H,groups,K,V,h0", CPU_CASES)
def test_matches_reference_fp32(kind, T, H, groups, K, V, h0):
    inputs = make_inputs(kind, 1, T, H, K, V, groups=groups, h0=h0, seed=T + 7 * H + K)
    check_against_reference(kind, inputs, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_bf16_inputs_on_cpu(kind):
    # bf16 inputs under the interpreter take the emulated bf16 path ("bf16emu"): the GPU bf16 path's roundings (bf16
    # product operands, bf16 W, U, Kd, states, V', dV', rounded to nearest) with exact fp32 products in place of the
    # bf16 tensor cores; errors 2e-3 to 3.5e-3 measured (o, state, every gradient), within the GPU bf16 bounds
    inputs = make_inputs(kind, 1, 75, 2, 32, 16, groups=2, h0=True, dtype=torch.bfloat16, seed=1)
    check_against_reference(kind, inputs, BF16_TOL_OUT, BF16_TOL_GRAD)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_batch_of_two(kind):
    inputs = make_inputs(kind, 2, 75, 1, 16, 16, h0=True, seed=3)
    check_against_reference(kind, inputs, FP32_TOL, FP32_TOL)


# (KEEP_FORWARD_FOR_BACKWARD, KEEP_CHUNK_STATES_FOR_BACKWARD, KDA_KEEP_INTRA_FOR_BACKWARD); the first recomputes
# every forward intermediate in the backward
KEEP_SETTINGS = {
    "recompute": (False, False, False),
    "keep_all": (True, True, True),
    "keep_wy_not_states": (True, False, True),
    "keep_wy_not_kda_intra": (True, True, False),
    "keep_kda_intra_only": (False, True, True),
}


def set_keep_switches(monkeypatch, setting):
    for name, value in zip(("KEEP_FORWARD_FOR_BACKWARD", "KEEP_CHUNK_STATES_FOR_BACKWARD",
                            "KDA_KEEP_INTRA_FOR_BACKWARD"), KEEP_SETTINGS[setting]):
        monkeypatch.setattr(chunk_module, name, value)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("h0", [False, True])
def test_kept_forward_intermediates_give_the_recomputed_gradients(kind, h0, monkeypatch):
    # Bitwise equality: a kept intermediate comes from the same kernel launch (same constants, _solve_wy with
    # STORE_T in both cases) on the same inputs as its recomputation in the backward, and the kernels are
    # deterministic (no atomics), so the backward kernels read identical bits. The outputs too: STORE_T only adds
    # the stores of T^-1 to _solve_wy.
    # one head: the interpreter's time grows with the heads, and test_matches_reference_fp32 covers three
    inputs = make_inputs(kind, 1, 75, 1, 32, 16, h0=h0, seed=11)
    gen = torch.Generator().manual_seed(2)
    do, dht = torch.randn(1, 75, 1, 16, generator=gen), torch.randn(1, 1, 32, 16, generator=gen)
    settings = [s for s in KEEP_SETTINGS if kind == "kda" or "kda_intra" not in s]
    results = {}
    for setting in settings:
        set_keep_switches(monkeypatch, setting)
        with nan_poisoned_allocations():
            results[setting] = run_with_grads(OPS[kind][0], inputs, do, dht)
    o_ref, st_ref, grads_ref = results.pop("recompute")
    for setting, (o, st, grads) in results.items():
        assert torch.equal(o, o_ref) and torch.equal(st, st_ref), setting
        for name, gr, gr_ref in zip(NAMES, grads, grads_ref):
            assert (gr is None and gr_ref is None) or torch.equal(gr, gr_ref), f"d{name} differs with {setting}"


class LaunchRecorder:
    """Stands in for a Triton kernel on the chunk module: records (name, launch keyword `key`) for each launch."""

    def __init__(self, kernel, name, log, key="STORE_T"):
        self.kernel, self.name, self.log, self.key = kernel, name, log, key

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.log.append((self.name, tuple(kwargs.get(k) for k in self.key) if isinstance(self.key, tuple)
                             else kwargs.get(self.key)))
            return launch(*args, **kwargs)
        return record


def test_state_pass_value_block_widens_only_when_the_sms_stay_filled(monkeypatch):
    monkeypatch.setattr(chunk_module, "multiprocessors", lambda device: 132)    # an H200
    cuda = torch.device("cuda")
    wide, narrow = chunk_module.STATE_FWD_WIDE_BV, chunk_module.BLOCK_V
    assert (wide, narrow) == (64, 32)
    assert chunk_module._state_fwd_bv(128, 4 * 32, cuda) == wide        # B=4 H=32: 256 programs of 64 values
    assert chunk_module._state_fwd_bv(128, 2 * 32, cuda) == narrow      # 128 programs of 64 would leave 4 SMs idle
    assert chunk_module._state_fwd_bv(128, 32, cuda) == narrow
    assert chunk_module._state_fwd_bv(32, 4096, cuda) == narrow         # V = 32: no wider block exists
    assert chunk_module._state_fwd_bv(16, 4096, cuda) == 16
    monkeypatch.setattr(chunk_module, "multiprocessors", lambda device: None)   # off CUDA
    assert chunk_module._state_fwd_bv(128, 4096, torch.device("cpu")) == narrow


def test_narrow_value_blocks_keep_eight_warps(monkeypatch):
    # the guard of FEW_WARPS_MIN_BV: fewer warps only where the GPU tests passed with them (wide value blocks)
    monkeypatch.setitem(chunk_module.WARPS, "bwd_wy", 4)
    monkeypatch.setitem(chunk_module.WARPS, "output", 2)
    monkeypatch.setitem(chunk_module.WARPS, "state_fwd", 2)
    warps = {(name, bv): chunk_module._value_block_kw(name, False, bv)["num_warps"]
             for name in ("bwd_wy", "output", "state_fwd") for bv in (16, 32, 64)}
    assert warps == {("bwd_wy", 16): 8, ("bwd_wy", 32): 4, ("bwd_wy", 64): 4,
                     ("output", 16): 8, ("output", 32): 8, ("output", 64): 2,
                     ("state_fwd", 16): 2, ("state_fwd", 32): 2, ("state_fwd", 64): 2}   # no guard for state_fwd


def force_wide_state_block(monkeypatch, launches):
    """Every _state_fwd launch then takes STATE_FWD_WIDE_BV (a device of one SM); records the launches' BV."""
    monkeypatch.setattr(chunk_module, "multiprocessors", lambda device: 1)
    monkeypatch.setattr(chunk_module, "_state_fwd_kernel",
                        LaunchRecorder(chunk_module._state_fwd_kernel, "state_fwd", launches, key="BV"))


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_wide_state_pass_value_block_matches_reference(kind, monkeypatch):
    launches = []
    force_wide_state_block(monkeypatch, launches)
    inputs = make_inputs(kind, 2, 75, 1, 16, 128, h0=True, seed=5)
    check_against_reference(kind, inputs, FP32_TOL, FP32_TOL)
    assert launches and all(bv == 64 for _, bv in launches), launches


# the kernels that GDN and KDA share, by their WARPS / STAGES names
SHARED_KERNELS = {"cumsum": "_cumsum_kernel", "solve_wy": "_solve_wy_kernel", "state_fwd": "_state_fwd_kernel",
                  "output": "_output_kernel", "dv_local": "_dv_local_kernel", "state_bwd": "_state_bwd_kernel",
                  "bwd_dqk": "_bwd_dqk_kernel", "bwd_wy": "_bwd_wy_kernel", "rev_cumsum": "_rev_cumsum_kernel"}


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_kda_launch_entries_set_every_shared_kernel_for_kda_only(kind, monkeypatch):
    # WARPS / STAGES "<name>_kda" entries (the sweeps' handle) reach each shared kernel's launch for KDA, not GDN's
    defaults = {short: chunk_module._kw(short, False) for short in SHARED_KERNELS}
    launches = []
    for short, name in SHARED_KERNELS.items():
        monkeypatch.setitem(chunk_module.WARPS, short + "_kda", 2)
        monkeypatch.setitem(chunk_module.STAGES, short + "_kda", 1)
        monkeypatch.setattr(chunk_module, name, LaunchRecorder(getattr(chunk_module, name), name, launches,
                                                               key=("num_warps", "num_stages")))
    # V = 64: _output keeps its default warps (no few-warps guard, FEW_WARPS_MIN_BV)
    inputs = make_inputs(kind, 1, 20, 1, 16, 64, h0=True, seed=13)
    gen = torch.Generator().manual_seed(4)
    run_with_grads(OPS[kind][0], inputs, torch.randn(1, 20, 1, 64, generator=gen),
                   torch.randn(1, 1, 16, 64, generator=gen))
    launched = {name for name, _ in launches}
    assert launched == set(SHARED_KERNELS.values())
    for short, name in SHARED_KERNELS.items():
        expected = (2, 1) if kind == "kda" else (defaults[short]["num_warps"], defaults[short]["num_stages"])
        assert all(setting == expected for launched_name, setting in launches if launched_name == name), name


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_forward_kernels_run_once_and_inference_keeps_nothing(kind, monkeypatch):
    # with the default switches the backward runs no forward kernel; without autograd _solve_wy stores no T^-1
    launches = []
    for name in ("_cumsum_kernel", "_kda_diag_kernel", "_kda_intra_kernel", "_solve_wy_kernel", "_state_fwd_kernel"):
        monkeypatch.setattr(chunk_module, name, LaunchRecorder(getattr(chunk_module, name), name, launches))
    inputs = make_inputs(kind, 1, 75, 1, 16, 16, h0=True, seed=12)
    kda_intra = [("_kda_diag_kernel", None), ("_kda_intra_kernel", None)]
    forward = [("_cumsum_kernel", None)] + (kda_intra if kind == "kda" else [])
    with torch.no_grad():
        OPS[kind][0](*inputs[:5], initial_state=inputs[5], output_final_state=True)
    assert launches == forward + [("_solve_wy_kernel", False), ("_state_fwd_kernel", None)]
    launches.clear()
    gen = torch.Generator().manual_seed(3)
    run_with_grads(OPS[kind][0], inputs, torch.randn(1, 75, 1, 16, generator=gen),
                   torch.randn(1, 1, 16, 16, generator=gen))
    assert launches == forward + [("_solve_wy_kernel", True), ("_state_fwd_kernel", None)]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_strong_decay_stays_finite_and_matches(kind):
    # g down to -5 per step (per channel for KDA): in-chunk cumulative decays reach about -300
    inputs = make_inputs(kind, 1, 130, 1, 32, 16, h0=True, gmin=-5.0, seed=11)
    check_against_reference(kind, inputs, FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_prefill_then_continue_equals_one_call(kind):
    chunk = OPS[kind][0]
    q, k, v, g, beta, s0 = make_inputs(kind, 1, 130, 1, 16, 16, h0=True, seed=5)
    o_full, s_full = chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    cut = 75
    o1, s1 = chunk(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=s0,
                   output_final_state=True)
    o2, s2 = chunk(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=s1,
                   output_final_state=True)
    # same kernels, same arithmetic up to where the chunk boundaries fall: fp32 rounding only (~1e-7 measured)
    assert rel_rms(torch.cat([o1, o2], 1), o_full) < 1e-5
    assert rel_rms(s2, s_full) < 1e-5
    # and the first part's state is the reference's state after the prompt
    _, s_ref = OPS[kind][1](q[:, :cut].double(), k[:, :cut].double(), v[:, :cut].double(), g[:, :cut].double(),
                            beta[:, :cut].double(), initial_state=s0.double(), output_final_state=True)
    assert rel_rms(s1, s_ref) < FP32_TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_padded_positions_leave_state_unchanged(kind):
    chunk = OPS[kind][0]
    q, k, v, g, beta, s0 = make_inputs(kind, 1, 70, 1, 16, 16, h0=True, seed=9)
    o, s = chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    # insert 6 padded positions (g = 0, beta = 0, k = v = 0; q arbitrary) after position 40 and 3 at the end
    pad_at, n_pad, n_tail = 40, 6, 3

    def padded(x, fill):
        shape = list(x.shape)
        mid = x.new_full([shape[0], n_pad] + shape[2:], fill)
        tail = x.new_full([shape[0], n_tail] + shape[2:], fill)
        return torch.cat([x[:, :pad_at], mid, x[:, pad_at:], tail], 1)

    qp = padded(q, 1.0)
    kp, vp, gp, bp = padded(k, 0.0), padded(v, 0.0), padded(g, 0.0), padded(beta, 0.0)
    op, sp = chunk(qp, kp, vp, gp, bp, initial_state=s0, output_final_state=True)
    keep = torch.cat([torch.arange(pad_at), torch.arange(pad_at + n_pad, pad_at + n_pad + 70 - pad_at)])
    # padded rows are exact no-ops; only the chunk boundaries move (fp32 rounding, ~1e-7 measured)
    assert rel_rms(sp, s) < 1e-5
    assert rel_rms(op[:, keep], o) < 1e-5
    # a sequence of padding only returns the initial state untouched
    _, s_only = chunk(qp[:, :5], torch.zeros_like(kp[:, :5]), torch.zeros_like(vp[:, :5]), torch.zeros_like(gp[:, :5]),
                      torch.zeros_like(bp[:, :5]), initial_state=s0, output_final_state=True)
    assert torch.equal(s_only, s0)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_chunk_spec_matches_recurrence(kind):
    _, naive, spec = OPS[kind]
    q, k, v, g, beta, s0 = (None if x is None else x.double()
                            for x in make_inputs(kind, 2, 130, 3, 16, 16, groups=2, h0=True, gmin=-5.0, seed=4))
    o1, s1 = naive(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, s2 = spec(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    # both in float64: the design doc's spec reproduces the recurrence to ~1e-15; 1e-10 allows T = 130 sums
    assert (o1 - o2).abs().max() < 1e-10 and (s1 - s2).abs().max() < 1e-10


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_without_final_state_and_default_scale(kind):
    chunk, naive, _ = OPS[kind]
    q, k, v, g, beta, _ = make_inputs(kind, 1, 20, 1, 16, 16, h0=False, seed=2)
    o, st = chunk(q, k, v, g, beta)
    assert st is None
    o_ref, _ = naive(q, k, v, g, beta, scale=16 ** -0.5)
    assert rel_rms(o, o_ref) < FP32_TOL
    o2, _ = chunk(q, k, v, g, beta, scale=0.3)
    o2_ref, _ = naive(q, k, v, g, beta, scale=0.3)
    assert rel_rms(o2, o2_ref) < FP32_TOL


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_torch_backend_runs_the_pytorch_chunked_form(kind):
    # Where Triton does not run (the CPU without the interpreter; forced here), the public function runs the
    # PyTorch chunked form instead, in float32 and still differentiable
    from retrofit.kernels import use_backend

    chunk, naive, _ = OPS[kind]
    q, k, v, g, beta, s0 = make_inputs(kind, 1, 70, 2, 16, 16, groups=2, h0=True, seed=6)
    q.requires_grad_()
    with use_backend("torch"):
        o, st = chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o_ref, st_ref = naive(q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=s0.double(),
                          output_final_state=True)
    assert o.dtype == v.dtype and st.dtype == torch.float32
    assert rel_rms(o, o_ref) < FP32_TOL and rel_rms(st, st_ref) < FP32_TOL
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_invalid_arguments_name_the_argument(kind):
    chunk = OPS[kind][0]
    q, k, v, g, beta, s0 = make_inputs(kind, 1, 8, 2, 16, 16, h0=True)
    with pytest.raises(ValueError, match="^k"):
        chunk(q, k[..., :8], v, g, beta)
    with pytest.raises(ValueError, match="^v"):
        chunk(q, k, v[:, :4], g, beta)
    with pytest.raises(ValueError, match="^g"):
        chunk(q, k, v, g[..., 0] if kind == "kda" else g[..., None].expand(1, 8, 2, 16), beta)
    with pytest.raises(ValueError, match="^beta"):
        chunk(q, k, v, g, beta[..., None])
    with pytest.raises(ValueError, match="^q"):
        chunk(q[:, :, :1].expand(1, 8, 3, 16), k, v, g, beta)     # 3 query heads for 2 kv heads
    with pytest.raises(ValueError, match="^initial_state"):
        chunk(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="^q"):
        chunk(q.double(), k, v, g, beta)
    with pytest.raises(ValueError, match="^k"):
        chunk(torch.randn(1, 8, 2, 24), torch.randn(1, 8, 2, 24), v,
              g if kind == "gdn" else torch.zeros(1, 8, 2, 24), beta)


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16 inputs (fp32 accumulation and state); run by `pytest -m gpu` on a CUDA machine

GPU_CASES = [
    # (B, T, H, groups, K, V, h0, g and beta in float32)
    (2, 1, 3, 1, 16, 16, True, False),
    (2, 63, 3, 1, 32, 16, False, False),
    (1, 75, 1, 1, 64, 64, True, False),
    (2, 130, 3, 1, 64, 64, True, False),
    (1, 130, 1, 3, 32, 16, True, False),
    (1, 300, 2, 1, 128, 128, True, False),
    (2, 200, 2, 2, 128, 64, False, False),
    (1, 257, 4, 1, 64, 128, True, False),
    # as the converted layers call the kernels (g and beta in float32, no initial state): SmolLM2's 9 query and 3 kv
    # heads of 64 dims, and Llama-3-8B's 128. (Cases like the last two passed on the H200 with the faulty _bwd_wy
    # mended on 2026-12-02 too; its kernel-level check is test_bwd_wy_kda_adds_t_transpose_dw.)
    (1, 300, 3, 3, 64, 64, False, True),
    (2, 300, 3, 3, 64, 64, False, True),
    (1, 300, 2, 1, 128, 128, False, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("B,T,H,groups,K,V,h0,fp32_gates", GPU_CASES)
def test_matches_reference_bf16_gpu(kind, B, T, H, groups, K, V, h0, fp32_gates):
    inputs = make_inputs(kind, B, T, H, K, V, groups=groups, h0=h0, dtype=torch.bfloat16,
                         gate_dtype=torch.float32 if fp32_gates else None, device="cuda", seed=T + K + V)
    check_against_reference(kind, inputs, BF16_TOL_OUT, BF16_TOL_GRAD)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("K,BK", [(64, 32), (64, 16), (128, 32)])
def test_bwd_wy_kda_adds_t_transpose_dw(request, device, K, BK):
    """KDA's _bwd_wy alone, at the launch settings chunk_bwd uses, on random inputs of a real layer's shapes (B = 1,
    T = 300, 3 kv heads): the dk it adds per chunk must be beta exp(G) (T^T dW), the products on bf16-rounded
    operands. On the H200 (triton 3.6, 4 warps) the kernel before 2026-12-02 added a wrong product at K = 64 (relative
    error ~1.1 at key blocks of 32, NaN at 16; right at 1, 2 or 8 warps), on the real layer's inputs and with k, v,
    dV', M and dW random (BENCHMARKS.md, History, 2026-12-02 — KDA's bf16 backward mended)."""
    if device == "cuda" and BK == 16:
        # measured on 2026-12-02 (H200, triton 3.6): the mended kernel still gives NaN at key blocks of 16; the layers
        # take blocks of 32 wherever K >= 32, so only K = 16 heads reach this (BENCHMARKS.md, History > Conversion >
        # 2026-12-02 — KDA hybrids re-run with the mended backward). strict: a pass would mean the fault is gone
        request.applymarker(pytest.mark.xfail(strict=True, reason="_bwd_wy gives NaN at BK = 16 on the H200"))
    B, T, H, V, BT = 1, 300, 3, K, chunk_module.CHUNK
    NT = -(-T // BT)
    Tp = NT * BT
    gen = torch.Generator().manual_seed(K + BK)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    k, v = rnd(B, T, H, K, scale=0.1).bfloat16(), rnd(B, T, H, V).bfloat16()
    beta = torch.rand(B, T, H, generator=gen).to(device)
    Gc = -torch.rand(B, H, Tp, K, generator=gen).cumsum(2).to(device) * 0.02
    M = rnd(B, H, Tp, BT, scale=0.3)
    Tinv = (torch.tril(torch.randn(B, H, NT, BT, BT, generator=gen) * 0.1, -1) + torch.eye(BT)).view(B, H, Tp, BT)
    Tinv = Tinv.to(device)
    dW, dVp = rnd(B, H, Tp, K), rnd(B, H, Tp, V).bfloat16()
    dk0 = rnd(B, T, H, K)
    dk, dv = dk0.clone(), torch.empty_like(v)
    dbeta, dG, dM = torch.empty(B, T, H, device=device), torch.zeros(B, H, Tp, K, device=device), torch.empty_like(M)
    prec = chunk_module._precisions(k)[0]
    BV = min(chunk_module.BLOCK_V, V)
    _bwd_wy_kernel[(NT, B * H)](k, v, beta, Gc, M, Tinv, dW, dVp, dk, dv, dbeta, dG, dM, T, Tp, H, K=K, V=V, BT=BT,
                                BV=BV, BK=BK, PER_CHANNEL=True, PREC=prec,
                                **chunk_module._value_block_kw("bwd_wy", True, BV))

    def bf16(x):  # the kernel's product operands
        return x.to(torch.bfloat16).double()

    t_transpose_dw = (bf16(Tinv.view(B, H, NT, BT, BT)).transpose(-1, -2) @ bf16(dW.view(B, H, NT, BT, K)))
    decayed = beta.double().permute(0, 2, 1)[..., None] * Gc.double().exp()[:, :, :T]        # [B, H, T, K]
    want = (decayed * t_transpose_dw.view(B, H, Tp, K)[:, :, :T]).permute(0, 2, 1, 3)         # [B, T, H, K]
    # the same bf16 operands, fp32 accumulation against fp64: 1e-7 measured for this closed form on the real layer's
    # launch (H200, mended kernel) and here under the interpreter; 1e-4 leaves room for other summation orders, and a
    # wrong product is off by 1e-1 or more (0.69 with T in place of T^T)
    assert rel_rms(dk - dk0, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("T,K,V", [(130, 32, 16), (300, 128, 128)])
def test_matches_reference_fp32_gpu(kind, T, K, V):
    inputs = make_inputs(kind, 1, T, 2, K, V, groups=2, h0=True, device="cuda", seed=T)
    # fp32 inputs use exact ("ieee") products on the GPU too: ~1e-6 measured; 2e-4 allows other summation orders
    check_against_reference(kind, inputs, 2e-4, 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_wide_state_pass_value_block_bf16_gpu(kind, monkeypatch):
    # the state pass at STATE_FWD_WIDE_BV, which the small cases above never reach on a device of many SMs
    launches = []
    force_wide_state_block(monkeypatch, launches)
    inputs = make_inputs(kind, 2, 300, 2, 128, 128, h0=True, dtype=torch.bfloat16, device="cuda", seed=8)
    check_against_reference(kind, inputs, BF16_TOL_OUT, BF16_TOL_GRAD)
    assert launches and all(bv == 64 for _, bv in launches), launches


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_strong_decay_bf16_gpu(kind):
    inputs = make_inputs(kind, 1, 400, 2, 128, 128, h0=True, gmin=-5.0, dtype=torch.bfloat16, device="cuda", seed=3)
    check_against_reference(kind, inputs, BF16_TOL_OUT, BF16_TOL_GRAD)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_forward_and_backward_repeatable_bf16_gpu(kind):
    # Triton kernels without atomics must give bitwise-identical outputs and gradients on identical inputs (the
    # forward's pipelined loops with several tl.dots, such as _kda_intra's, are checked too). On the H200 with
    # triton 3.6, _bwd_dqk at 2 pipelining stages gave a different dq in 7 of 29 runs of this case through the
    # backward that recomputes the forward (all 29 at 4 warps); 20 repeats catch a failure rate of that size with
    # probability > 0.99. Both backward paths run: autograd's (the forward keeps its intermediates) and the
    # recomputing one. Freed memory is overwritten between runs so that a read of stale data shows too.
    from retrofit.kernels.delta_common.chunk import chunk_bwd
    q, k, v, g, beta, s0 = inputs = make_inputs(kind, 1, 300, 2, 128, 128, h0=True, dtype=torch.bfloat16,
                                                device="cuda", seed=556)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(1, 300, 2, 128, generator=gen).to("cuda", torch.bfloat16)
    dht = torch.randn(1, 2, 128, 128, generator=gen).to("cuda")
    first = {}
    for repeat in range(20):
        scribble = torch.full((16 << 20,), float(repeat), device="cuda")
        del scribble
        o, state, grads = run_with_grads(OPS[kind][0], inputs, do, dht)
        runs = {"autograd": [o, state, *grads],
                "recompute": chunk_bwd(q, k, v, g, beta, 128 ** -0.5, s0, do, dht, kind == "kda")}
        for path, grads in runs.items():
            first.setdefault(path, grads)
            for i, (grad, grad0) in enumerate(zip(grads, first[path])):
                assert torch.equal(grad, grad0), f"{path}: result {i} differs between repeat 0 and repeat {repeat}"
