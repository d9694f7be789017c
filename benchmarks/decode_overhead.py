"""What one decode token dispatches, per variant and engine: aten operations, the kernels among them, host
synchronisations (CPU), Triton launches, and on CUDA the kernel launches the host issues.

A tiny Llama with the layer structure of Llama-3-8B's depth (32 layers, GQA 4 query / 2 kv heads of 16 dims, hidden
64, vocab 256) makes the compute negligible, so the counts are the host-side work a real model pays per token:

    python benchmarks/decode_overhead.py                      # CPU: ops and syncs, PyTorch paths of the kernels
    TRITON_INTERPRET=1 python benchmarks/decode_overhead.py --backend triton  # CPU, Triton interpreter: the
                                                              # engine's fused decode layers, + Triton launches
    python benchmarks/decode_overhead.py --device cuda        # + kernel launches per token (torch.profiler)
    ... --layers 2 / --layers 3                               # per decoder layer: the difference of the two

Counts are per decode token: the counts of a generation of 8 + 32 new tokens minus those of 8, over 32 (stop checks
included, the prefill excluded; no end-of-sequence token stops it), after one uncounted generation of 8 (the first
call of a shape builds the cache that later calls keep; before 2026-12-02's evening runs it was counted, which made
the graph rows' aten counts negative). ``aten ops`` counts every aten operation,
views and allocations included; ``kernels`` counts those that launch a GPU kernel (views, allocations and metadata
queries left out: ``retrofit.bench.overhead.launches_kernel``) plus the Triton launches: the kernels a CUDA graph of
the step holds, a few microseconds each. A Triton launch is not counted as aten operations (on the CPU the
interpreter emulates it with copies that a GPU launch does not issue). The fused decode layers
(``retrofit.generation.fused_layers``, on by default) are installed only where the kernels run on Triton:
``--backend triton`` on the CPU, or CUDA. Engines: ``transformers`` (``model.generate``, growing cache)
and ``retrofit`` (``retrofit.generate``: static cache; on CUDA the step is a captured graph, so the host launches
one graph per token); where the kernels run on Triton also ``retrofit-unfused`` (``fuse_layers=False``: the model's
own decoder layers); on CUDA also ``retrofit-eager`` / ``retrofit-unfused-eager``, the same steps launched without
the graph (``cuda_graph=False``),
whose kernel launches per token are the kernels the graph holds (for this tiny model's
shapes: cuBLAS may pick other kernels, e.g. split-K reductions, at Llama-3-8B's). Results in
benchmarks/history/figures-2026-12-06.md, "Decode overhead per token", and BENCHMARKS.md, "End-to-end generation".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import retrofit  # noqa: E402
from retrofit.bench.overhead import per_decode_token, triton_launches  # noqa: E402
from retrofit.kernels import backend_for, use_backend  # noqa: E402
from retrofit.sparse import sparse_decoding  # noqa: E402
from retrofit.variants import parse_variant_spec  # noqa: E402

PROMPT = 300
BUDGET = 256
VARIANTS = {
    "dense": None,
    f"quest@{BUDGET}": ("quest", {"page_size": 16}),
    f"streaming@{BUDGET}": ("streaming", {}),
    f"clusterkv@{BUDGET}": ("clusterkv", {"n_clusters": 32}),
    f"retrieval@{BUDGET}": ("retrieval", {}),
    f"seer@{BUDGET}": ("seer", {"random_gates": True}),
    "gdn 24/32": "convert:gdn:not:every:4",
    "kda 24/32": "convert:kda:not:every:4",
}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def tiny_llama(device: torch.device, layers: int = 32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    return model


@contextlib.contextmanager
def opened(model, variant):
    if variant is None:
        yield model
    elif isinstance(variant, str):
        with parse_variant_spec(variant).open(model, None) as hybrid:
            # the hybrid is a model built from the config, whose generation config names an end token again: a
            # transformers generation that drew it would stop early and count as fewer steps
            hybrid.generation_config.eos_token_id = None
            yield hybrid
    else:
        method, params = variant
        with sparse_decoding(model, method=method, budget=BUDGET, **params):
            yield model


def generator(model, engine: str, ids: torch.Tensor):
    mask = torch.ones_like(ids)
    if engine == "transformers":
        return lambda n: model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    cuda_graph = False if engine.endswith("-eager") else None
    fuse_layers = not engine.startswith("retrofit-unfused")
    return lambda n: retrofit.generate(model, ids, mask, max_new_tokens=n, eos_token_id=[], pad_token_id=0,
                                       cuda_graph=cuda_graph, fuse_layers=fuse_layers)


def engines(device: torch.device, backend: str) -> tuple[str, ...]:
    """The engines measured on ``device``: retrofit's step also without its graph on CUDA (to count the kernels the
    graph holds; on the CPU the step is never captured, so that row would repeat ``retrofit``'s), and with its fused
    decoder layers (the default) and without them (``retrofit-unfused``) where the kernels run on Triton (elsewhere
    they are not installed)."""
    names = ["transformers", "retrofit"] + (["retrofit-eager"] if device.type == "cuda" else [])
    with use_backend(backend):
        on_triton = backend_for(device) == "triton"
    if on_triton:
        names += ["retrofit-unfused"] + (["retrofit-unfused-eager"] if device.type == "cuda" else [])
    return tuple(names)


def launches_per_token(generate, tokens: int = 32, base: int = 8) -> dict[str, float]:
    """CUDA runtime/driver launch calls per decode token (torch.profiler), by name."""
    from torch.profiler import ProfilerActivity, profile

    def count(n: int) -> dict[str, int]:
        generate(n)  # warm: compiled kernels, captured graphs
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            generate(n)
            torch.cuda.synchronize()
        return {event.key: event.count for event in prof.key_averages() if event.key in LAUNCHES}

    short, long = count(base), count(base + tokens)
    return {name: (long.get(name, 0) - short.get(name, 0)) / tokens for name in LAUNCHES
            if long.get(name, 0) != short.get(name, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from the table")
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the tiny Llama (per-layer counts: "
                        "the difference of two runs)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.backend == "triton" and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--backend triton on the CPU needs TRITON_INTERPRET=1 in the environment")
    device = torch.device(args.device)
    model = tiny_llama(device, args.layers)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    print("| variant | engine | aten ops / token | kernels / token | host syncs / token | Triton launches / token "
          "| CUDA launches / token |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.variants.split(","):
        for engine in engines(device, args.backend):
            with torch.no_grad(), use_backend(args.backend), opened(model, VARIANTS[name]) as measured:
                generate = generator(measured, engine, ids)
                launched: dict[int, int] = {}  # new tokens -> Triton launches of that run

                def counted(new_tokens: int):
                    with triton_launches() as launches:
                        generate(new_tokens)
                    launched[new_tokens] = launches[0]

                counts = per_decode_token(counted)
                short, long = sorted(launched)
                triton_per_token = (launched[long] - launched[short]) / (long - short) if launched[long] else None
                cuda = launches_per_token(generate) if device.type == "cuda" else {}
            kernels = counts.kernels + (triton_per_token or 0)
            row = {"variant": name, "engine": engine, "ops": counts.ops, "kernels": kernels, "syncs": counts.syncs,
                   "sync_names": counts.sync_names, "triton_launches": triton_per_token, "cuda_launches": cuda,
                   "layers": args.layers}
            rows.append(row)
            cuda_text = ", ".join(f"{key} {value:g}" for key, value in cuda.items())
            triton_text = "" if triton_per_token is None else f"{triton_per_token:g}"
            print(f"| {name} | {engine} | {counts.ops:,.0f} | {kernels:,.0f} | {counts.syncs:g} | {triton_text} | "
                  f"{cuda_text} |", flush=True)
    if args.json:
        from retrofit.atomic import write_json

        write_json(args.json, {"rows": rows, "device": str(device), "backend": args.backend,
                               "torch": torch.__version__})


if __name__ == "__main__":
    main()
