"""Decode-step attention time per layer: Quest (page scores + top-k + sparse kernel, all on GPU) vs dense SDPA.

Random-weight Llama-3-8B attention shapes (32 query / 8 kv heads, head dim 128, bf16), budget 2048 tokens in pages
of 16, batch 1 and 8, contexts 32K and 128K, timed side by side with ``triton.testing.do_bench`` (L2 flushed between
runs). The Quest step is the exact code path ``sparse_decoding`` runs (``Quest.select`` then
``sparse_decode_attention`` on a real ``SparseLayer``), timed eagerly and replayed from a CUDA graph (launch overhead
removed). Dense is the fastest SDPA backend (cuDNN, flash, efficient) x GQA layout (group folded into the query
length, or enable_gqa) that runs here, named in the table; the design doc's dense figures are shown beside it. Also: the
bytes each method holds per layer and sequence, and the "bytes floor" (metadata + selected K/V at 4.46 TB/s).

    python benchmarks/sparse_decode.py                       # the full table (H200: ~3 minutes)
    python benchmarks/sparse_decode.py --json out.json --contexts 32768 --batches 1
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

H_Q, H_KV, HEAD_DIM = 32, 8, 128
HBM_BYTES_PER_S = 4.46e12  # dense SDPA's measured bandwidth on the H200 (design/sparse_decode.md)
# dense SDPA decode step measured for design/sparse_decode.md (H200, torch 2.11): (batch, context) -> us
DESIGN_DOC_DENSE_US = {(1, 8192): 22.5, (1, 32768): 50.0, (1, 131072): 140.1, (8, 32768): 256.5, (8, 131072): 963.4}


def _layer(method, keys, values):
    from retrofit.sparse.cache import SparseLayer

    layer = SparseLayer(layer_idx=2, method=method)
    layer.update(keys, values)
    layer.padding_known = True
    method.prepare(layer, 0, layer.length)
    return layer


def time_quest_vs_dense(batch: int, context: int, budget: int, page: int, graphs: bool) -> dict:
    import triton.testing

    from retrofit.kernels.sparse_decode import (
        quest_page_scores,
        sparse_decode_attention,
        sparse_decode_attention_ref,
        topk_indices,
    )
    from retrofit.sparse import build_method

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, H_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, H_KV, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, H_KV, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    quest = build_method("quest", budget, page_size=page, dense_layers=())
    layer = _layer(quest, k, v)
    keys, values = layer.keys, layer.values
    group = H_Q // H_KV

    def dense_candidates():
        """SDPA decode on every backend and GQA layout that runs here: the fastest one is the dense baseline."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        layouts = {
            "folded": lambda: torch.nn.functional.scaled_dot_product_attention(
                q.view(batch, H_KV, group, HEAD_DIM), k, v),  # the group's 4 queries as rows of one kv head
            "enable_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True),
        }
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for layout, call in layouts.items():
                def run(call=call, backend=backend):
                    with sdpa_kernel([backend]):
                        return call()
                try:
                    run()
                    torch.cuda.synchronize()
                except RuntimeError:
                    continue
                yield f"{backend.name.lower()}/{layout}", run

    def step():
        sel = quest.select(layer, q)
        return sparse_decode_attention(q, keys, values, sel.indices, sel.counts, layer.kv_start, layer.kv_end,
                                       block_size=sel.block_size)

    sel = quest.select(layer, q)
    out = step()
    ref = sparse_decode_attention_ref(q, keys, values, sel.indices, sel.counts, layer.kv_start, layer.kv_end, page)
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    meta = layer.meta
    num_pages = meta["num_pages"]
    scores = quest_page_scores(q, meta["page_min"], meta["page_max"], num_pages, layer.kv_start, page)
    dense_times = {name: 1e3 * triton.testing.do_bench(run) for name, run in dense_candidates()}
    dense_backend = min(dense_times, key=dense_times.get)
    result = {
        "batch": batch, "context": context, "budget": budget, "page_size": page,
        "dense_us": dense_times[dense_backend], "dense_backend": dense_backend, "dense_all_us": dense_times,
        "dense_design_doc_us": DESIGN_DOC_DENSE_US.get((batch, context)),
        "quest_us": 1e3 * triton.testing.do_bench(step),
        "scores_us": 1e3 * triton.testing.do_bench(
            lambda: quest_page_scores(q, meta["page_min"], meta["page_max"], num_pages, layer.kv_start, page)),
        "topk_us": 1e3 * triton.testing.do_bench(lambda: topk_indices(scores.view(-1, num_pages), budget // page)),
        "torch_topk_us": 1e3 * triton.testing.do_bench(
            lambda: torch.topk(scores.view(-1, num_pages), budget // page, dim=-1)),
        "attention_us": 1e3 * triton.testing.do_bench(lambda: sparse_decode_attention(
            q, keys, values, sel.indices, sel.counts, layer.kv_start, layer.kv_end, block_size=page)),
        "kernel_vs_reference_rel_err": error,
    }
    if graphs:
        for _ in range(3):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        result["quest_graph_us"] = 1e3 * triton.testing.do_bench(graph.replay)
    floor_bytes = batch * H_KV * HEAD_DIM * 2 * (2 * num_pages + 2 * budget)
    result["floor_us"] = 1e6 * floor_bytes / HBM_BYTES_PER_S
    best = min(result["quest_us"], result.get("quest_graph_us", float("inf")))
    result["speedup"] = result["dense_us"] / best
    if result["dense_design_doc_us"]:
        result["speedup_vs_design_doc_dense"] = result["dense_design_doc_us"] / best
    return result


def memory_per_method(context: int, budget: int, gate_path: Path, device: str) -> dict[str, dict[str, int]]:
    """Bytes one layer holds per sequence (batch 1), per component, for each method at this context."""
    from retrofit.sparse import METHODS, build_method

    params = {
        "streaming": {}, "quest": {"dense_layers": ()}, "clusterkv": {}, "retrieval": {"index": "Flat"},
        "seer": {"gate_path": str(gate_path)},
    }
    gen = torch.Generator(device=device).manual_seed(1)
    k = torch.randn(1, H_KV, context, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, H_KV, context, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    held = {"dense": {"kv": 2 * k.numel() * k.element_size()}}
    for name in METHODS.names():
        layer = _layer(build_method(name, budget, **params.get(name, {})), k, v)
        held[name] = layer.memory_bytes()
        del layer
    return held


def markdown(rows: list[dict], memory: dict) -> str:
    lines = ["| batch | context | dense SDPA (us) [backend] | dense, design doc (us) | quest eager (us) | quest graph (us) "
             "| scores | top-k ours / torch | attention | bytes floor (us) | speedup | vs doc dense | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        doc = r.get("dense_design_doc_us")
        lines.append(
            f"| {r['batch']} | {r['context'] // 1024}K | {r['dense_us']:.1f} [{r['dense_backend']}] | "
            f"{doc if doc else '-'} | {r['quest_us']:.1f} | "
            f"{r.get('quest_graph_us', float('nan')):.1f} | "
            f"{r['scores_us']:.1f} | "
            f"{r['topk_us']:.1f} / {r['torch_topk_us']:.1f} | "
            f"{r['attention_us']:.1f} | {r['floor_us']:.1f} | {r['speedup']:.2f}x | "
            f"{r.get('speedup_vs_design_doc_dense', float('nan')):.2f}x | {r['kernel_vs_reference_rel_err']:.1e} |")
    for context, held in memory.items():
        lines += ["", f"Memory held per layer and sequence at {int(context) // 1024}K context (MiB):", "",
                  "| method | " + " | ".join(["kv", "metadata / index", "total"]) + " |", "|---|---|---|---|"]
        for name, parts in held.items():
            extra = sum(size for key, size in parts.items() if key not in ("kv", "total"))
            total = parts["kv"] + extra
            lines.append(f"| {name} | {parts['kv'] / 2**20:.2f} | {extra / 2**20:.2f} | {total / 2**20:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--no-graph", action="store_true", help="Skip the CUDA-graph replay timing.")
    parser.add_argument("--no-memory", action="store_true", help="Skip the per-method memory table.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results as JSON here.")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/sparse_decode.py needs a CUDA GPU", file=sys.stderr)
        return 2
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [time_quest_vs_dense(b, c, args.budget, args.page_size, not args.no_graph)
            for b in (int(x) for x in args.batches.split(",")) for c in contexts]
    memory: dict = {}
    if not args.no_memory:
        from retrofit.sparse.methods.seer import SeerGates

        with tempfile.TemporaryDirectory() as tmp:
            gate_path = Path(tmp) / "random.gates"
            SeerGates(list(range(4)), H_Q, H_KV, HEAD_DIM, hidden=128, block_size=64).save(gate_path)
            for context in contexts:
                memory[str(context)] = memory_per_method(context, args.budget, gate_path, "cuda")
    print(markdown(rows, memory))
    if args.json:
        payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "memory": memory}
        from retrofit.atomic import write_json

        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
