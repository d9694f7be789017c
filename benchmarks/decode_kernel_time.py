"""Where the GPU time of one decode step goes: each kernel's device time per token (torch.profiler), grouped by
kernel, for retrofit's engine with its fused decoder layers (the default) and without (``retrofit-unfused``), at one
context x batch point.

    python benchmarks/decode_kernel_time.py --config llama3-8b --context 4096 --batch 1 [--top 25] [--json OUT]
    python benchmarks/decode_kernel_time.py --context 131072 --variant quest:budget=2048   # a variant's step

Random weights of the config's real shapes, bf16, on CUDA; ``--variant`` takes any variant spec of ``retrofit
bench`` (``quest:budget=2048``, ``seer:budget=2048,random_gates=true``, ``convert:gdn:not:every:4``, ...; default
dense). The step runs eagerly under the profiler (a replayed
graph runs the same kernels back to back; the profiler cannot see inside it), so "kernel time" is the sum of the
kernels' own durations: what the step would take with no gap between kernels. Comparing it with the step time of
``retrofit bench`` (graph replay) splits the step into kernel work and the gaps between kernels.
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import torch

from retrofit.bench.configs import build_random_model
from retrofit.generation import DecodeLoop, SamplingOptions, StaticGeneration
from retrofit.generation.sampling import TokenChooser
from retrofit.errors import RetrofitError
from retrofit.variants import parse_variant_spec

GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|cublas|sm90_xmma|splitKreduce", re.IGNORECASE)


def kernel_times(model, context: int, batch: int, fuse_layers: bool, steps: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (device microseconds per token, launches per token)} over ``steps`` eager decode steps."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        generation = StaticGeneration(model, ids, mask, steps + 8, TokenChooser(SamplingOptions(), ids.device), [], 0,
                                      fuse_layers=fuse_layers)
        loop = DecodeLoop(generation, use_graph=False)
        with generation.installed():
            generation.prefill()
            loop.run(3, stop_at_end=False)  # compiled kernels, autotuning
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                loop.run(steps, stop_at_end=False)
                torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = times[event.name]
            entry[0] += event.time_range.elapsed_us() / steps
            entry[1] += 1 / steps
    return {name: (us, count) for name, (us, count) in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama3-8b")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--variant", default="dense", help="a variant spec as `retrofit bench --variant` takes it")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        variant = parse_variant_spec(args.variant)
    except RetrofitError as error:  # its message names the option already
        parser.error(str(error))
    if not torch.cuda.is_available():
        parser.error("needs CUDA: kernel durations come from the GPU's own timeline")
    model = build_random_model(args.config, torch.bfloat16, torch.device("cuda"))
    results = {}
    with variant.open(model, None) as measured:
        for fuse_layers in (False, True):
            results["retrofit" if fuse_layers else "retrofit-unfused"] = kernel_times(
                measured, args.context, args.batch, fuse_layers, args.steps)
    for engine, times in results.items():
        gemm = sum(us for name, (us, _) in times.items() if GEMM.search(name))
        total = sum(us for us, _ in times.values())
        launches = sum(count for _, count in times.values())
        print(f"\n## {engine}, {variant.name}: {args.config}, context {args.context}, batch {args.batch}: "
              f"kernel time {total / 1e3:.3f} ms per token in {launches:,.0f} kernels (GEMM {gemm / 1e3:.3f} ms, "
              f"the rest {(total - gemm) / 1e3:.3f})")
        print("| kernel | us / token | kernels / token | us each |\n|---|---:|---:|---:|")
        for name, (us, count) in sorted(times.items(), key=lambda item: -item[1][0])[:args.top]:
            print(f"| `{name[:90]}` | {us:,.1f} | {count:g} | {us / count:.2f} |")
    if args.json:
        from retrofit.atomic import write_json

        kernels = {engine: {name: {"us_per_token": us, "per_token": n} for name, (us, n) in times.items()}
                   for engine, times in results.items()}
        write_json(args.json, {"config": args.config, "variant": variant.name, "context": args.context,
                               "batch": args.batch, "steps": args.steps, "kernels": kernels})


if __name__ == "__main__":
    main()
