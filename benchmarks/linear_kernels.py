"""Linear-attention kernels side by side: retrofit vs flash-linear-attention (fla) vs torch SDPA (flash).

One run, same inputs for every implementation: H=32, K=V=128, bf16 (fp32 gates and state).

- chunk forward, GDN and KDA, at (B=1, T=16384) and (B=4, T=8192)
- chunk forward + backward, GDN and KDA, at (B=1, T=16384), with the memory the forward holds for the backward
  (autograd's saved intermediates and the output) and the peak over both
- recurrent decode step (T=1, state updated), GDN and KDA, at B=1 and B=64, plain launch and CUDA graph
- torch SDPA causal (flash backend) forward at T=16384 and 65536, and at the chunk shapes

Usage (GPU machine; fla wheels on PYTHONPATH, or it measures ours + SDPA only)::

    python benchmarks/linear_kernels.py --json $OUT/linear.json            # timings
    python benchmarks/linear_kernels.py --check --json $OUT/check.json     # bf16 outputs ours vs fla (rel RMS)
    python benchmarks/linear_kernels.py --tune-decode                      # recurrent block-size sweep
    python benchmarks/linear_kernels.py --profile                          # our chunk kernels, time per Triton kernel
    python benchmarks/linear_kernels.py --only chunk --kind kda --repeats 5  # ours and fla alternating, 5 rounds

Timing: ``triton.testing.do_bench`` (warm-up, then the median of CUDA-event timed calls). Ratios near 1.0 are at
the level of run-to-run drift (about 0.3% for the chunk forward on the H200): ``--repeats`` alternates ours and fla
over several rounds and reports the per-round ratios' spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

H, K, V = 32, 128, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
CHUNK_SHAPES = ((1, 16384), (4, 8192))  # (B, T) for chunk forward
FWD_BWD_SHAPE = (1, 16384)  # (B, T) for chunk forward + backward
DECODE_BATCHES = (1, 64)
SDPA_SHAPES = ((1, 16384, False), (4, 8192, False), (1, 65536, False), (1, 16384, True))  # (B, T, backward)
CHECK_SHAPE = (2, 4096)  # (B, T) for --check


@dataclass
class Row:
    op: str
    shape: str
    tokens: int  # tokens processed per call (B*T, or B for a decode step)
    ours_ms: float | None = None
    fla_ms: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """fla time / our time (> 1: ours is faster)."""
        if self.ours_ms is None or self.fla_ms is None:
            return None
        return self.fla_ms / self.ours_ms

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.ours_ms is None else self.tokens / (self.ours_ms / 1e3)


def load_fla():
    """fla's ops as a dict, or (None, reason) when fla is not importable."""
    try:
        import fla  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as error:  # any import failure means "measure without fla"; the reason is printed
        return None, f"{type(error).__name__}: {error}"
    ops = {
        "chunk_gdn": chunk_gated_delta_rule,
        "chunk_kda": chunk_kda,
        "recurrent_gdn": fused_recurrent_gated_delta_rule,
        "recurrent_kda": fused_recurrent_kda,
    }
    return ops, getattr(fla, "__version__", "unknown")


def load_ours():
    from retrofit.kernels import fused_recurrent_gated_delta_rule, fused_recurrent_kda
    ops = {"recurrent_gdn": fused_recurrent_gated_delta_rule, "recurrent_kda": fused_recurrent_kda}
    try:
        from retrofit.kernels import chunk_gated_delta_rule, chunk_kda
        ops["chunk_gdn"], ops["chunk_kda"] = chunk_gated_delta_rule, chunk_kda
    except ImportError as error:
        print(f"our chunk kernels are not importable ({error}); chunk rows measure fla only")
    return ops


def make_inputs(B: int, T: int, kda: bool, requires_grad: bool = False, seed: int = 0):
    """q, k (L2-normalised), v in bf16; g (log decay, fp32; per key channel for KDA, clamped at -5), beta (bf16)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    def randn(*shape, dtype=DTYPE):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)
    q = randn(B, T, H, K)
    k = F.normalize(randn(B, T, H, K, dtype=torch.float32), dim=-1).to(DTYPE)
    v = randn(B, T, H, V)
    g_shape = (B, T, H, K) if kda else (B, T, H)
    # slow decays, as in converted layers (log decay between about -0.7 and -0.002), never below -5
    g = F.logsigmoid(randn(*g_shape, dtype=torch.float32) + 4.0).clamp_min(-5.0)
    beta = torch.sigmoid(randn(B, T, H, dtype=torch.float32)).to(DTYPE)
    tensors = [q, k, v, g, beta]
    if requires_grad:
        for t in tensors:
            t.requires_grad_(True)
    return tensors


def bench(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def try_bench(fn) -> tuple[float | None, str]:
    """(median ms, "") or (None, "refused: <message>") when the implementation raises."""
    try:
        return bench(fn), ""
    except Exception as error:  # report, don't crash: e.g. fla's GDN backward on some triton/Hopper pairs
        message = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return None, f"refused: {type(error).__name__}: {message}"


def fwd_bwd_memory_mib(step_forward, do) -> dict:
    """Memory of one forward + backward, in MiB (2**20 bytes) beyond what was allocated before it: "held" = what the forward
    leaves allocated for the backward (autograd's saved intermediates plus the output o), "peak" = the peak over
    forward and backward."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = step_forward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    o.backward(do)
    del o
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"held_mib": round(held / 2**20, 1), "peak_mib": round(peak / 2**20, 1)}


def bench_alternating(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Times each fn of `fns` (name -> callable) in `repeats` rounds, the fns alternating within a round, so that slow
    drifts of the GPU (clocks, temperature) fall on every fn alike. Returns ({name: [ms per round]}, {name: note}); a
    fn that raises is dropped after its first round with its "refused: ..." note."""
    times: dict = {name: [] for name in fns}
    notes: dict = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            if name in notes:
                continue
            ms, note = try_bench(fn)
            if note:
                notes[name] = note
            else:
                times[name].append(ms)
    return times, notes


def chunk_rows(ours, fla, rows: list[Row], kinds=("gdn", "kda"), repeats: int = 1) -> None:
    scale = K ** -0.5
    for kind in kinds:
        for B, T in CHUNK_SHAPES:
            q, k, v, g, beta = make_inputs(B, T, kind == "kda")
            row = Row(f"{kind} chunk fwd", f"B={B} T={T}", B * T)
            fns = {who: (lambda op=ops[f"chunk_{kind}"]: op(q, k, v, g, beta, scale=scale, output_final_state=True))
                   for who, ops in (("ours", ours), ("fla", fla)) if ops is not None and f"chunk_{kind}" in ops}
            with torch.no_grad():
                times, refused = bench_alternating(fns, repeats)
            row.ours_ms = statistics.median(times["ours"]) if times.get("ours") else None
            row.fla_ms = statistics.median(times["fla"]) if times.get("fla") else None
            notes = [f"{who} {note}" for who, note in refused.items()]
            if repeats > 1 and times.get("ours") and times.get("fla"):
                ratios = [f / o for o, f in zip(times["ours"], times["fla"])]
                row.extra.update(ours_ms_rounds=times["ours"], fla_ms_rounds=times["fla"], ratio_rounds=ratios)
                notes.append(f"{repeats} alternating rounds, medians; fla/ours per round {min(ratios):.3f} to "
                             f"{max(ratios):.3f}, median {statistics.median(ratios):.3f}")
            row.note = "; ".join(notes)
            rows.append(row)
            print_row(row)
        B, T = FWD_BWD_SHAPE
        q, k, v, g, beta = make_inputs(B, T, kind == "kda", requires_grad=True)
        do = torch.randn(B, T, H, V, device=DEVICE, dtype=DTYPE)
        row = Row(f"{kind} chunk fwd+bwd", f"B={B} T={T}", B * T)
        notes = []
        for who, ops, attr in (("ours", ours, "ours_ms"), ("fla", fla, "fla_ms")):
            if ops is None or f"chunk_{kind}" not in ops:
                continue
            op = ops[f"chunk_{kind}"]
            def forward():
                for t in (q, k, v, g, beta):
                    t.grad = None
                return op(q, k, v, g, beta, scale=scale)[0]
            ms, note = try_bench(lambda: forward().backward(do))
            setattr(row, attr, ms)
            if note:
                notes.append(f"{who} {note}")
            else:
                for t in (q, k, v, g, beta):
                    t.grad = None  # freed before the baseline, so that "held" starts from the inputs alone
                memory = fwd_bwd_memory_mib(forward, do)
                row.extra[who] = memory
                notes.append(f"{who} held {memory['held_mib']:.0f} MiB, peak {memory['peak_mib']:.0f} MiB")
        row.note = "; ".join(notes)
        rows.append(row)
        print_row(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def capture(fn):
    """A CUDA graph of ``fn()`` (warmed up eagerly first); returns the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def decode_rows(ours, fla, rows: list[Row]) -> None:
    from retrofit.kernels import RecurrentDecodeGraph
    scale = K ** -0.5
    # The plain B=1 step is bound by the host's launch path. The first such measurement of a process ran up to 5x
    # slow on the H200 (36.8 us for ours and 196 for fla's, then 6.4 and 40 in the next process: BENCHMARKS.md,
    # History > Linear-attention kernels > 2026-11-30 — KDA forward past fla, `_bwd_wy` at 4 warps, decode blocks
    # that widen with the batch), so one measurement of each implementation is taken first and discarded.
    q, k, v, g, beta = make_inputs(1, 1, False, seed=1)
    state = torch.zeros(1, H, K, V, device=DEVICE, dtype=torch.float32)
    try_bench(lambda: ours["recurrent_gdn"](q, k, v, g, beta, scale=scale, initial_state=state, inplace_state=True))
    if fla is not None:
        try_bench(lambda: fla["recurrent_gdn"](q, k, v, g, beta, scale=scale, initial_state=state.clone(),
                                               output_final_state=True))
    for kind in ("gdn", "kda"):
        for B in DECODE_BATCHES:
            q, k, v, g, beta = make_inputs(B, 1, kind == "kda", seed=1)
            state = torch.randn(B, H, K, V, device=DEVICE, dtype=torch.float32) * 0.1
            ours_op = ours[f"recurrent_{kind}"]
            plain = Row(f"{kind} decode step", f"B={B}", B)
            plain.ours_ms, note = try_bench(lambda: ours_op(q, k, v, g, beta, scale=scale, initial_state=state,
                                                            inplace_state=True))
            notes = [f"ours {note}"] if note else []
            graphed = Row(f"{kind} decode step (CUDA graph)", f"B={B}", B)
            try:
                step = RecurrentDecodeGraph(state, per_key_decay=kind == "kda", dtype=DTYPE, scale=scale)
                step(q, k, v, g, beta)
                graphed.ours_ms = bench(step.replay)
            except Exception as error:
                graphed.note = f"ours refused: {type(error).__name__}: {error}"[:200]
            if fla is not None:
                fla_op = fla[f"recurrent_{kind}"]
                fla_state = state.clone()
                def fla_step():
                    return fla_op(q, k, v, g, beta, scale=scale, initial_state=fla_state, output_final_state=True)
                plain.fla_ms, note = try_bench(fla_step)
                if note:
                    notes.append(f"fla {note}")
                try:
                    graph = capture(fla_step)
                    graphed.fla_ms = bench(graph.replay)
                except Exception as error:
                    graphed.note = (graphed.note + f"; fla graph refused: {type(error).__name__}: {error}")[:300]
            plain.note = "; ".join(notes)
            for row in (plain, graphed):
                rows.append(row)
                print_row(row)


def sdpa_rows(rows: list[Row]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for B, T, backward in SDPA_SHAPES:
        q, k, v = (torch.randn(B, H, T, K, device=DEVICE, dtype=DTYPE, requires_grad=backward) for _ in range(3))
        row = Row("sdpa causal fwd+bwd (torch flash)" if backward else "sdpa causal fwd (torch flash)",
                  f"B={B} T={T}", B * T)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if backward:
                do = torch.randn_like(q)
                def step():
                    for t in (q, k, v):
                        t.grad = None
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
                row.ours_ms, row.note = try_bench(step)
            else:
                with torch.no_grad():
                    row.ours_ms, row.note = try_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        row.note = ("(torch SDPA in the 'ours' column) " + row.note).strip()
        rows.append(row)
        print_row(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_rms / ||b||_rms in float64."""
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def check(ours, fla) -> dict:
    """Our bf16 outputs vs fla's on the same inputs: rel RMS per output (and per gradient for the chunk forms)."""
    results: dict[str, dict[str, float | str]] = {}
    scale = K ** -0.5
    B, T = CHECK_SHAPE
    for kind in ("gdn", "kda"):
        name = f"chunk_{kind}"
        if name in ours:
            q, k, v, g, beta = make_inputs(B, T, kind == "kda", requires_grad=True, seed=2)
            h0 = torch.randn(B, H, K, V, device=DEVICE) * 0.1
            do = torch.randn(B, T, H, V, device=DEVICE, dtype=DTYPE)
            outs = {}
            for who, ops in (("ours", ours), ("fla", fla)):
                try:
                    o, ht = ops[name](q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
                    grads = torch.autograd.grad(o, (q, k, v, g, beta), do)
                    outs[who] = {"o": o.detach(), "state": ht.detach(),
                                 **{f"d{n}": t for n, t in zip(("q", "k", "v", "g", "beta"), grads)}}
                except Exception as error:
                    outs[who] = f"refused: {type(error).__name__}: {error}"[:200]
            results[name] = compare(outs)
        name = f"recurrent_{kind}"
        q, k, v, g, beta = make_inputs(B, 64, kind == "kda", seed=3)
        h0 = torch.randn(B, H, K, V, device=DEVICE) * 0.1
        outs = {}
        for who, ops in (("ours", ours), ("fla", fla)):
            try:
                o, ht = ops[name](q, k, v, g, beta, scale=scale, initial_state=h0.clone(), output_final_state=True)
                outs[who] = {"o": o, "state": ht}
            except Exception as error:
                outs[who] = f"refused: {type(error).__name__}: {error}"[:200]
        results[name] = compare(outs)
    for name, metrics in results.items():
        print(f"check {name}: " + ", ".join(f"{m}={v:.2e}" if isinstance(v, float) else f"{m}: {v}"
                                            for m, v in metrics.items()))
    return results


def compare(outs: dict) -> dict:
    ours, theirs = outs.get("ours"), outs.get("fla")
    if isinstance(ours, str) or isinstance(theirs, str):
        return {"ours": ours if isinstance(ours, str) else "ok", "fla": theirs if isinstance(theirs, str) else "ok"}
    return {name: rel_rms(ours[name], theirs[name]) for name in ours}


def profile_chunk(ops, who: str = "ours", kinds: tuple[str, ...] = ("gdn", "kda")) -> dict:
    """CUDA time per kernel of one implementation's chunk forward and forward+backward at FWD_BWD_SHAPE
    (torch.profiler, 3 calls each); ``ops`` is ``load_ours()`` or fla's dict.

    Prints one table per (kind, pass) and returns {"gdn fwd": {kernel: ms per call}, ...}; a pass that raises (fla's
    GDN backward on triton 3.6 / Hopper) is reported and skipped.
    """
    from torch.profiler import ProfilerActivity, profile

    B, T = FWD_BWD_SHAPE
    scale = K ** -0.5
    results: dict[str, dict[str, float]] = {}
    for kind in kinds:
        fn = ops.get(f"chunk_{kind}")
        if fn is None:
            continue
        q, k, v, g, beta = make_inputs(B, T, kind == "kda", requires_grad=True)
        do = torch.randn(B, T, H, V, device=DEVICE, dtype=DTYPE)

        def forward():
            with torch.no_grad():
                fn(q, k, v, g, beta, scale=scale, output_final_state=True)

        def forward_backward():
            o, _ = fn(q, k, v, g, beta, scale=scale, output_final_state=True)
            o.backward(do)

        for label, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
            try:
                step()  # compile outside the profile
                torch.cuda.synchronize()
            except Exception as error:
                print(f"\n{who} {kind} chunk {label}: {type(error).__name__}: {str(error)[:120]}")
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            per_kernel = {event.key: event.device_time_total / 3 / 1e3 for event in prof.key_averages()
                          if event.device_time_total > 0}
            ordered = dict(sorted(per_kernel.items(), key=lambda item: -item[1]))
            results[f"{kind} {label}"] = ordered
            print(f"\n{who} {kind} chunk {label}, B={B} T={T}: {sum(ordered.values()):.3f} ms of kernels per call")
            for name, ms in list(ordered.items())[:12]:
                print(f"  {ms:8.3f} ms  {name[:90]}")
    return results


def tune_chunk() -> dict:
    """Sweep warps and pipelining stages of each chunk-forward kernel (one at a time, the others at their
    defaults) and the value blocks, timing the whole forward at B=1 T=16384; prints ms per setting and the best
    setting per kernel. Forward only: a setting adopted from here must still pass the GPU tests (backward shares
    BLOCK_V)."""
    import importlib
    chunk = importlib.import_module("retrofit.kernels.delta_common.chunk")
    ours = load_ours()
    scale = K ** -0.5
    results: dict[str, dict[str, float]] = {}
    for kind, kernels in (("gdn", ("solve_wy", "state_fwd", "output")),
                          ("kda", ("kda_intra", "solve_wy_kda", "state_fwd", "output"))):
        fn = ours[f"chunk_{kind}"]
        q, k, v, g, beta = make_inputs(1, 16384, kind == "kda")

        def forward():
            with torch.no_grad():
                fn(q, k, v, g, beta, scale=scale, output_final_state=True)

        def timed(label: str) -> float | None:
            ms, note = try_bench(forward)
            print(f"tune {kind} {label}: {fmt(ms, 4)} ms {note}", flush=True)
            results.setdefault(kind, {})[label] = ms
            return ms

        base = timed("defaults")
        for name in kernels:
            saved_w, saved_s = dict(chunk.WARPS), dict(chunk.STAGES)
            best = (base, "defaults")
            for warps in (2, 4, 8):
                for stages in (1, 2, 3, 4):
                    chunk.WARPS[name], chunk.STAGES[name] = warps, stages
                    ms = timed(f"{name} warps={warps} stages={stages}")
                    if ms is not None and (best[0] is None or ms < best[0]):
                        best = (ms, f"warps={warps} stages={stages}")
            chunk.WARPS.clear(); chunk.WARPS.update(saved_w)
            chunk.STAGES.clear(); chunk.STAGES.update(saved_s)
            print(f"best {kind} {name}: {best[1]} {fmt(best[0], 4)} ms (defaults {fmt(base, 4)})", flush=True)
        for attr, values in (("BLOCK_V", (16, 32, 64)), ("BLOCK_V_OUT", (32, 64, 128))):
            saved = getattr(chunk, attr)
            for value in values:
                setattr(chunk, attr, value)
                timed(f"{attr}={value}")
            setattr(chunk, attr, saved)
    return results


def tune_decode() -> None:
    """Sweep the recurrent kernel's V block and warps for the decode step (prints median us)."""
    import triton
    from retrofit.kernels.gated_delta_rule.fused_recurrent import recurrent_delta_rule_kernel
    for kind in ("gdn", "kda"):
        for B in (1, 64):
            q, k, v, g, beta = make_inputs(B, 1, kind == "kda", seed=1)
            state = torch.randn(B, H, K, V, device="cuda") * 0.1
            o = torch.empty_like(v)
            for BV in (8, 16, 32, 64):
                for num_warps in (1, 2, 4, 8):
                    grid = (triton.cdiv(V, BV), B * H)
                    def launch():
                        recurrent_delta_rule_kernel[grid](
                            q, k, v, g, beta, o, state, state, K ** -0.5, 1, H=H, GROUP=1, K=K, V=V,
                            BK=K, BV=BV, PER_KEY_DECAY=kind == "kda", USE_INITIAL_STATE=True,
                            STORE_FINAL_STATE=True, num_warps=num_warps)
                    try:
                        graph = capture(launch)
                        print(f"tune {kind} B={B} BV={BV} warps={num_warps}: {bench(graph.replay) * 1e3:.1f} us")
                    except Exception as error:
                        print(f"tune {kind} B={B} BV={BV} warps={num_warps}: failed {type(error).__name__}")


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_row(row: Row) -> None:
    print(f"  {row.op:38s} {row.shape:16s} ours {fmt(row.ours_ms, 4)} ms  fla {fmt(row.fla_ms, 4)} ms  {row.note}",
          flush=True)


def markdown(rows: list[Row]) -> str:
    lines = ["| op | shape | ours ms | fla ms | fla/ours | tokens/s (ours) | note |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        tps = "-" if row.tokens_per_s is None else f"{row.tokens_per_s:,.0f}"
        lines.append(f"| {row.op} | {row.shape} | {fmt(row.ours_ms, 4)} | {fmt(row.fla_ms, 4)} | "
                     f"{fmt(row.ratio, 2)} | {tps} | {row.note} |")
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    """``payload`` as indented JSON (values JSON has no type for as their text), written atomically."""
    from retrofit.atomic import write_text

    write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--check", action="store_true", help="compare our bf16 outputs with fla's (rel RMS) instead of timing")
    parser.add_argument("--tune-decode", action="store_true", help="sweep the recurrent kernel's block sizes")
    parser.add_argument("--tune-chunk", action="store_true",
                        help="sweep warps/stages/value blocks of the chunk-forward kernels")
    parser.add_argument("--profile", action="store_true", help="CUDA time per kernel of our chunk kernels")
    parser.add_argument("--only", choices=["chunk", "decode", "sdpa"], action="append",
                        help="run only these groups (repeatable); default all")
    parser.add_argument("--kind", choices=["gdn", "kda"], action="append",
                        help="chunk rows of these layer kinds only (repeatable); default both")
    parser.add_argument("--repeats", type=int, default=1,
                        help="chunk forward rows: time ours and fla alternately in this many rounds and report the "
                             "medians with the spread of the per-round ratio (default 1)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not torch.cuda.is_available():
        print("linear_kernels.py needs a CUDA GPU")
        return 2
    import triton
    fla, fla_info = load_fla()
    fla_version = fla_info if fla is not None else None
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"fla: {fla_info}" if fla is not None else f"fla not importable ({fla_info}): measuring ours + SDPA only")
    ours = load_ours()
    payload: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                     "fla": fla_version, "shape": {"H": H, "K": K, "V": V, "dtype": "bfloat16"}}
    if args.tune_decode:
        tune_decode()
        return 0
    if args.tune_chunk:
        payload["tune_chunk"] = tune_chunk()
        if args.json:
            write_json(args.json, payload)
        return 0
    if args.profile:
        payload["profile"] = profile_chunk(ours)
        if fla is not None:
            payload["profile_fla"] = profile_chunk(fla, "fla")
        if args.json:
            write_json(args.json, payload)
        return 0
    if args.check:
        if fla is None:
            print("--check needs fla")
            return 2
        payload["check"] = check(ours, fla)
    else:
        groups = args.only or ["chunk", "decode", "sdpa"]
        rows: list[Row] = []
        if "chunk" in groups:
            chunk_rows(ours, fla, rows, tuple(args.kind or ("gdn", "kda")), args.repeats)
        if "decode" in groups:
            decode_rows(ours, fla, rows)
        if "sdpa" in groups:
            sdpa_rows(rows)
        table = markdown(rows)
        print()
        print(table)
        payload["rows"] = [{**asdict(r), "ratio_fla_over_ours": r.ratio, "tokens_per_s": r.tokens_per_s} for r in rows]
        payload["markdown"] = table
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
