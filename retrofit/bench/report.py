"""The Markdown table and JSON of `retrofit bench`."""
from __future__ import annotations

import math

from retrofit.bench.measure import OUT_OF_MEMORY, BenchPoint

GIB = 1024 ** 3
MIB = 1024 ** 2


def _context(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def variant_notes(details: dict[str, dict]) -> list[str]:
    """One line per variant that converts layers: which layers of how many, e.g.
    ``convert:gdn:not:every:4: gdn in 24 of 32 layers (0-2, 4-6, ...); softmax attention in 3, 7, ...``."""
    notes = []
    for name, facts in details.items():
        if "converted_layers" not in facts:
            continue
        converted, total = facts["converted_layers"], facts["num_layers"]
        kept = [i for i in range(total) if i not in set(converted)]
        notes.append(f"{name}: {facts['layer_type']} in {len(converted)} of {total} layers "
                     f"({_layer_list(converted)}); softmax attention in {_layer_list(kept) or 'none'}.")
    return notes


def fusion_note(coverage: dict) -> str:
    """One line: which decoder layers the engine's decode step runs fused on Triton, and which run unfused
    (:func:`retrofit.generation.fused_layers.fusion_coverage`)."""
    total, layers, attention = coverage["total"], coverage["layers"], coverage["attention"]
    if not coverage["record"]:
        return (f"decode fusion (Triton): none of the {total} decoder layers; {coverage['family']} has no fused decode "
                "path, its layers run the model's own forward.")
    unfused = [i for i in range(total) if i not in set(layers)]
    own_attention = [i for i in layers if i not in set(attention)]
    line = f"decode fusion (Triton): {len(layers)} of {total} decoder layers fused"
    if unfused:
        line += f"; unfused: {_layer_list(unfused)}"
    if own_attention:
        line += f"; attention unfused in {_layer_list(own_attention)}"
    if coverage.get("sliding"):
        line += (f"; sliding-window layers {_layer_list(coverage['sliding'])} run their own attention over a ring "
                 "where the window is shorter than the cache")
    return line + "."


def out_of_memory_notes(points: list[BenchPoint]) -> list[str]:
    """One line per variant, engine and context at which a batch ran out of memory, saying what did fit, as
    measured in this run: the largest batch at that context, else the longest context at the smallest batch that
    failed there, else that nothing fit."""
    notes = []
    failed: dict[tuple[str, str, int], list[int]] = {}
    for point in points:
        if point.error and point.error.startswith(OUT_OF_MEMORY):
            failed.setdefault((point.variant, point.engine, point.context), []).append(point.batch)
    fitted = [p for p in points if not p.error]
    for (variant, engine, context), batches in failed.items():
        head = (f"{variant} ({engine}) at {_context(context)}: batch {', '.join(map(str, sorted(batches)))} ran out of "
                "memory")
        same_length = [p for p in fitted if (p.variant, p.engine, p.context) == (variant, engine, context)]
        smaller = [p for p in fitted if (p.variant, p.engine) == (variant, engine) and p.batch <= min(batches)]
        if same_length:
            best = max(same_length, key=lambda p: p.batch)
            notes.append(f"{head}; batch {best.batch} fit (peak {best.peak_bytes / GIB:.2f} GiB): run --batch "
                         f"{best.batch} at this length, or another --device.")
        elif smaller:
            best = max(smaller, key=lambda p: (p.context, p.batch))
            notes.append(f"{head}; {_context(best.context)} fit at batch {best.batch} (peak "
                         f"{best.peak_bytes / GIB:.2f} GiB): try --batch 1, a shorter --context, --dtype bfloat16 or "
                         "another --device.")
        else:
            notes.append(f"{head}, and no point of it fit: try --batch 1, a shorter --context, --dtype bfloat16, "
                         "--layers N or another --device.")
    return notes


def _layer_list(indices: list[int]) -> str:
    """``[0, 1, 2, 4, 5, 6]`` -> ``0-2, 4-6``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _percent(value: float) -> str:
    return "" if math.isnan(value) else f"{100 * value:.0f}%"


def markdown_table(points: list[BenchPoint], notes: list[str] | None = None, bandwidth: float | None = None) -> str:
    """One row per (variant, context, batch): prefill s and tokens/s, time to first token and the prefill's speed-up
    over dense at the same point and engine, decode ms/token (median, with its spread over the repeats) and tokens/s,
    the decode speed-up over dense, the bytes floor of a step and the ratio to it, peak memory, its rise over the
    start, and cache MiB; then a legend, ``notes`` (one line each) and, where a sparse prefill ran, the share of the
    blocks each layer computed (:func:`blocks_table`)."""
    dense = {(p.engine, p.context, p.batch): p for p in points if p.variant == "dense"}
    lines = ["| variant | engine | context | batch | prefill s | prefill tok/s | TTFT s | prefill vs dense | "
             "decode ms/tok | spread | decode tok/s | vs dense | floor ms | x floor | graph | peak GiB | Δpeak GiB | "
             "cache MiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for point in points:
        head = f"| {point.variant} | {point.engine} | {_context(point.context)} | {point.batch} |"
        if point.error:
            lines.append(head + f" {point.error} |" + " |" * 13)
            continue
        reference = dense.get((point.engine, point.context, point.batch))
        usable = reference is not None and not reference.error
        ratio = (point.decode_tokens_per_s / reference.decode_tokens_per_s
                 if usable and reference.decode_tokens_per_s > 0 else math.nan)
        prefill_ratio = reference.prefill_s / point.prefill_s if usable and point.prefill_s > 0 else math.nan
        graph = {True: "yes", False: "no", None: ""}[point.captured]
        lines.append(head + f" {point.prefill_s:.3f} | {point.prefill_tokens_per_s:,.0f} | {point.ttft_s:.3f} | "
                     f"{prefill_ratio:.2f}x | {1000 * point.decode_s_per_token:.2f} | {_percent(point.decode_spread)} | "
                     f"{point.decode_tokens_per_s:,.1f} | {ratio:.2f}x | {1000 * point.floor_s_per_token:.3f} | "
                     f"{point.floor_ratio:.1f} | {graph} | {point.peak_bytes / GIB:.2f} | "
                     f"{point.peak_delta_bytes / GIB:.2f} | {point.cache_bytes / MIB:,.1f} |")
    memory_kind = next((p.memory_kind for p in points if p.memory_kind), "")
    repeats = max((p.repeats for p in points), default=1)
    lines.append("")
    lines.append("prefill s = the prompt's forward and the first token chosen; TTFT = time to first token (the same and "
                 "the token's copy to the host); prefill vs dense = dense's prefill s over this row's.")
    lines.append(f"decode ms/tok = median of {repeats} timed runs per point (spread = (max - min) / median); floor = "
                 "bytes a step reads (weights + the keys/values or states it reads) over the copy bandwidth"
                 + (f" measured in this run ({bandwidth / 1e9:,.1f} GB/s)" if bandwidth else "")
                 + "; x floor = decode / floor; graph = the decode step replayed as a captured CUDA graph "
                 f"(retrofit engine); peak = highest {memory_kind} bytes during prefill+decode; Δpeak = peak minus the "
                 "bytes in use before it (weights); cache = bytes held by the cache after the run.")
    if any(p.captured is False and p.variant.startswith("retrieval") for p in points):
        lines.append("retrieval: its decode step is not captured (the faiss search runs on the host): per sparse layer "
                     "and step the query is copied to the host (a device synchronisation) and the hits back.")
    lines.extend(notes or [])
    lines.extend(out_of_memory_notes(points))
    blocks = blocks_table(points)
    if blocks:
        lines += ["", blocks]
    return "\n".join(lines)


def blocks_table(points: list[BenchPoint]) -> str:
    """Where a sparse prefill ran: the share of the causal (head, query block, key block) triples each layer computed
    in a point's first timed prefill, one row per layer and one column per (variant, engine, context, batch), with
    the mean over layers first ("dense" in a column whose calls all had fewer keys than ``min_length``); "" if none
    ran."""
    measured = [p for p in points if p.blocks_computed]
    if not measured:
        return ""
    names = [f"{p.variant} {p.engine} {_context(p.context)}x{p.batch}" for p in measured]
    lines = ["blocks computed by sparse prefill (% of the causal blocks, first timed run):", "",
             "| layer | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def cell(point: BenchPoint, value: float) -> str:
        return f"{100 * value:.1f}" if point.prefill_sparse else "dense"

    means = [cell(p, sum(p.blocks_computed.values()) / len(p.blocks_computed)) for p in measured]
    lines.append("| mean | " + " | ".join(means) + " |")
    layers = sorted({layer for p in measured for layer in p.blocks_computed})
    for layer in layers:
        row = [cell(p, p.blocks_computed[layer]) if layer in p.blocks_computed else "" for p in measured]
        lines.append(f"| {layer} | " + " | ".join(row) + " |")
    return "\n".join(lines)
