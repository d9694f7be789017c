"""Successive ``retrofit.generate`` calls of one shape: the kept cache and graph (``keep_state=True``, the default)
against a fresh cache and a new capture per call (``keep_state=False``), side by side in one run.

    python benchmarks/generate_calls.py --config llama3-8b --device cuda --dtype bfloat16 --context 4096
    python benchmarks/generate_calls.py --config smollm2-135m --layers 2 --device cpu --context 256 --calls 4

Random weights of the named config's real shapes. Each call gets another prompt of the same cache bucket (lengths
``context - 8 * i``); the first call of each mode is reported apart (it allocates and captures in both modes). The
figure is what a caller of ``generate`` waits for per call, prefill included; each mode runs twice, interleaved.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import retrofit
from retrofit.bench.configs import build_random_model
from retrofit.devices import parse_device, parse_dtype
from retrofit.generation import release


def timed_calls(model, prompts: list[torch.Tensor], new_tokens: int, keep_state: bool) -> list[float]:
    seconds = []
    release(model)
    for ids in prompts:
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        retrofit.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0,
                          keep_state=keep_state)
        if ids.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    release(model)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_random_model(args.config, dtype, device, args.layers)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (args.batch, args.context - 8 * i), generator=generator)
               .to(device) for i in range(args.calls)]
    rows = {}
    with torch.no_grad():
        for mode, keep_state in (("fresh per call", False), ("kept", True), ("fresh per call (again)", False),
                                 ("kept (again)", True)):
            seconds = timed_calls(model, prompts, args.new_tokens, keep_state)
            rows[mode] = {"first_s": seconds[0], "median_rest_s": statistics.median(seconds[1:]), "all_s": seconds}
    print(f"| mode | first call s | median of calls 2-{args.calls} s |")
    print("|---|---:|---:|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['first_s']:.3f} | {row['median_rest_s']:.3f} |")
    fresh = statistics.median([rows["fresh per call"]["median_rest_s"], rows["fresh per call (again)"]["median_rest_s"]])
    kept = statistics.median([rows["kept"]["median_rest_s"], rows["kept (again)"]["median_rest_s"]])
    print(f"fresh / kept per call: {fresh / kept:.2f}x ({args.config}, context {args.context}, batch {args.batch}, "
          f"{args.new_tokens} new tokens, {device}, {dtype})")
    if args.json is not None:
        from retrofit.atomic import write_json
        write_json(args.json, {"rows": rows, "fresh_over_kept": fresh / kept, "config": vars(args) | {
            "json": str(args.json), "versions": {"torch": torch.__version__}}})


if __name__ == "__main__":
    main()
