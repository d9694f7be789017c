"""Where one layer's sparse prefill spends its time, beside dense attention, at Llama-3-8B's attention shapes.

    python benchmarks/sparse_prefill_parts.py --device cuda [--lengths 8192,32768,130048] [--max-density 0.1]

Random bf16 queries, keys and values [1, 32 | 8, T, 128]; per length, the medians of ``triton.testing.do_bench`` timings
of: dense causal attention (SDPA, grouped heads), XAttention's estimate and block choice (its products in bf16 as the
attention receives them, and in fp32 for comparison), the Triton block-sparse kernel on that choice at 4 and 8 warps,
and the share of blocks it computes. A speed measurement, not a test: run it on the GPU.
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F
import triton.testing

from retrofit.kernels.sparse_prefill import sparse_prefill_attention
from retrofit.sparse.prefill.blocks import BlockGrid, block_lists
from retrofit.sparse.prefill.methods import XAttention


def timed(fn) -> float:
    """Median milliseconds of ``fn()`` (``triton.testing.do_bench``: warm-up, then CUDA-event timed calls)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="8192,32768,130048")
    parser.add_argument("--max-density", type=float, default=0.1)
    args = parser.parse_args()
    Hq, Hkv, D = 32, 8, 128
    method = XAttention(max_density=args.max_density, min_length=0)
    print("| T | dense SDPA ms | estimate + choice ms (bf16 products) | (fp32 products) | kernel ms, 4 warps | "
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
        choose_fp32 = timed(lambda: block_lists(method.choose(q.float(), k.float(), grid, scale)))
        indices, counts = block_lists(method.choose(q, k, grid, scale))
        share = counts.sum().item() / (int(grid.causal().sum()) * Hq)
        kernel = {warps: timed(lambda: sparse_prefill_attention(q, k, v, indices, counts, kv_start,
                                                                method.block_size, num_warps=warps))
                  for warps in (4, 8)}
        print(f"| {T} | {dense:.2f} | {choose:.2f} | {choose_fp32:.2f} | {kernel[4]:.2f} | {kernel[8]:.2f} | "
              f"{100 * share:.1f}% | {(choose + kernel[4]) / dense:.2f} | {(choose + kernel[8]) / dense:.2f} |",
              flush=True)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
