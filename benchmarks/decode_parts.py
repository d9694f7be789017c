"""What the rest of a fused dense decode step could still give: the decode attention's launch choices, and the
projections' GEMMs merged (q/k/v in one, gate/up in one) against one per module, at Llama-3-8B shapes.

    python benchmarks/decode_parts.py [--json OUT]

CUDA only, bf16, each point replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``: launch overhead out,
the median of the replays). Attention: ``sparse_decode_attention`` over a static cache's selection of every block of
64 (what the engine's dense step runs), 32 query / 8 kv heads of 128, context x batch at 4K/32K x 1/8, for the
default launch and a grid of ``num_splits`` x ``block_n``; GB/s counts the keys and values read. GEMMs: ``x [B, 4096]``
times transposed weight views, as the fused layers call them, B = 1 and 8. Nothing here changes the engine: the
table tells which change is worth making (BENCHMARKS.md, History > End-to-end generation).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
NEW_TOKENS = 64  # cache capacity: the context and this many new tokens, rounded up as the engine rounds


def _bench(fn) -> float:
    """Median microseconds of ``fn`` replayed from a CUDA graph."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def attention_rows(contexts: list[int], batches: list[int]) -> list[dict]:
    from retrofit.generation.engine import AllBlocks, cache_capacity
    from retrofit.kernels.sparse_decode import sparse_decode_attention

    rows = []
    for batch in batches:
        for context in contexts:
            capacity = cache_capacity(context + NEW_TOKENS)
            keys = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            values = torch.randn_like(keys)
            query = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            every_block = AllBlocks.of(keys)  # the selection the engine's dense step reads
            start = torch.zeros(batch, device="cuda", dtype=torch.int64)
            end = torch.full((1,), context, device="cuda", dtype=torch.int64).expand(batch)
            read = 2 * batch * KV_HEADS * context * HEAD_DIM * keys.element_size()
            for splits in (None, 8, 16, 32, 64, 128, 256):
                for block_n in (32, 64, 128):
                    if splits is None and block_n != 64:
                        continue
                    launch = {} if splits is None else {"num_splits": splits, "block_n": block_n}
                    us = _bench(lambda: sparse_decode_attention(query, keys, values, every_block.indices,
                                                                every_block.counts, start, end,
                                                                block_size=every_block.block_size, **launch))
                    row = {"part": "attention", "batch": batch, "context": context,
                           "launch": "default" if splits is None else f"splits {splits}, block_n {block_n}",
                           "us": us, "GB/s": read / us / 1e3}
                    rows.append(row)
                    print(f"| attention | {batch} | {context} | {row['launch']} | {us:.1f} | {row['GB/s']:,.0f} |",
                          flush=True)
            del keys, values
    return rows


def gemm_rows(batches: list[int]) -> list[dict]:
    rows = []
    groups = {"q, k, v": (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM),
              "gate, up": (INTERMEDIATE, INTERMEDIATE)}
    for batch in batches:
        x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for name, outs in groups.items():
            weights = [torch.randn(out, HIDDEN, device="cuda", dtype=torch.bfloat16) for out in outs]
            merged = torch.cat(weights)
            read = merged.numel() * merged.element_size()
            separate = _bench(lambda: [torch.mm(x, weight.t()) for weight in weights])
            together = _bench(lambda: torch.mm(x, merged.t()))
            for how, us in (("one GEMM per module", separate), ("merged", together)):
                rows.append({"part": name, "batch": batch, "launch": how, "us": us, "GB/s": read / us / 1e3})
                print(f"| {name} | {batch} | - | {how} | {us:.1f} | {read / us / 1e3:,.0f} |", flush=True)
            del weights, merged
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the parts are timed from CUDA graph replays")
    contexts = [int(value) for value in args.contexts.split(",")]
    batches = [int(value) for value in args.batches.split(",")]
    print("| part | batch | context | launch | us | GB/s |\n|---|---:|---:|---|---:|---:|")
    rows = gemm_rows(batches) + attention_rows(contexts, batches)
    if args.json:
        from retrofit.atomic import write_json

        write_json(args.json, {"device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
