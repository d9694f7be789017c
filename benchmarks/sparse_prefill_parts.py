"""Where one layer's sparse prefill spends its time, beside dense attention, at Llama-3-8B's attention shapes.

    python benchmarks/sparse_prefill_parts.py --device cuda [--lengths 8192,32768,130048] [--max-density 0.1]

Random bf16 queries, keys and values [1, 32 | 8, T, 128]; per length, the medians of ``triton.testing.do_bench`` timings
of: dense causal attention (SDPA, grouped heads), XAttention's estimate and block choice (the fused Triton estimate,
and its PyTorch reference for comparison), the Triton block-sparse kernel on that choice at 4 and 8 warps (8 is its
default at blocks of 128), and the share of blocks it computes. A speed measurement, not a test: run it on the GPU.
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F
import triton.testing

from retrofit.kernels import use_backend
from retrofit.kernels.sparse_prefill import sparse_prefill_attention
from retrofit.kernels.sparse_prefill.estimate import antidiagonal_block_mass_triton
from retrofit.sparse.prefill.blocks import BlockGrid, block_lists
from retrofit.sparse.prefill.methods import XAttention


def timed(fn) -> float:
    """Median milliseconds of ``fn()`` (``triton.testing.do_bench``: warm-up, then CUDA-event timed calls)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def estimate_launches(method: XAttention, q, k, grid: BlockGrid, scale: float) -> None:
    """Milliseconds of the fused estimate's kernel (block mass only, no choice) per launch setting: tile, features per
    product step, warps."""
    S, bs = method.stride, method.block_size
    T = q.shape[2]
    runs_q, runs_k = method.runs(q, k, grid)
    first_run = grid.first_block * bs // S
    times = []
    for tile, block_e, warps in ((64, 64, 4), (64, 128, 4), (64, 64, 8), (128, 64, 8), (128, 128, 8), (32, 128, 4)):
        ms = timed(lambda: antidiagonal_block_mass_triton(runs_q, runs_k, grid.kv_start, bs // S, S, first_run,
                                                          grid.q_offset, T, scale / S,
                                                          tile=tile, block_e=block_e, num_warps=warps))
        times.append(f"tile {tile} e {block_e} w {warps}: {ms:.2f}")
    print(f"|   estimate kernel at {T}: " + "; ".join(times) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="8192,32768,130048")
    parser.add_argument("--max-density", type=float, default=0.1)
    parser.add_argument("--tune-estimate", action="store_true",
                        help="also time the fused estimate's kernel alone at several launch settings")
    args = parser.parse_args()
    Hq, Hkv, D = 32, 8, 128
    method = XAttention(max_density=args.max_density, min_length=0)
    print("| T | dense SDPA ms | estimate + choice ms (fused) | (reference) | kernel ms, 4 warps | "
          "8 warps | blocks computed | sparse / dense (4 warps) | (8 warps) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for T in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(0)
        q = torch.randn(1, Hq, T, D, device=args.device, dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, T, D, device=args.device, dtype=torch.bfloat16)
        v = torch.randn(1, Hkv, T, D, device=args.device, dtype=torch.bfloat16)
        kv_start = torch.zeros(1, dtype=torch.long, device=args.device)
        grid = BlockGrid(T, T, 0, method.block_size, kv_start)
        scale = D ** -0.5
        dense = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        choose = timed(lambda: block_lists(method.choose(q, k, grid, scale)))
        with use_backend("torch"):
            choose_reference = timed(lambda: block_lists(method.choose(q, k, grid, scale)))
        indices, counts = block_lists(method.choose(q, k, grid, scale))
        share = counts.sum().item() / (int(grid.causal().sum()) * Hq)
        kernel = {warps: timed(lambda: sparse_prefill_attention(q, k, v, indices, counts, kv_start,
                                                                method.block_size, num_warps=warps))
                  for warps in (4, 8)}
        print(f"| {T} | {dense:.2f} | {choose:.2f} | {choose_reference:.2f} | {kernel[4]:.2f} | {kernel[8]:.2f} | "
              f"{100 * share:.1f}% | {(choose + kernel[4]) / dense:.2f} | {(choose + kernel[8]) / dense:.2f} |",
              flush=True)
        if args.tune_estimate:
            estimate_launches(method, q, k, grid, scale)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
