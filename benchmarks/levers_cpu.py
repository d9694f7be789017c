"""The conversion levers alone and combined at equal tokens, on SmolLM2 at a CPU's scale: which ones the GPU runs.

Every variant converts the same 22 of 30 layers of SmolLM2-135M-Instruct (the layers of ``kda-22of30``, chosen by
the scored selector on an H200; the layer-choice lever takes the set that ``select: max_run: 4`` picks from that
ranking instead) on the ``smollm2-135m/cpu-small`` recipe's settings with the token budget given, then each hybrid
and the dense model are scored on the first ``--limit`` windows of 1,024 tokens of wikitext2's test file (the
``retrofit eval --tasks wikitext2`` protocol, ``retrofit.eval.perplexity``): perplexity, and the mean per-token
KL(dense || hybrid) on the same windows, the yardstick every variant shares (their stage-2 losses weigh different
terms). A Markdown table is the last output; ``--json`` keeps the numbers.

    OMP_NUM_THREADS=1 python benchmarks/levers_cpu.py --data ../shared/data/calib --eval-data ../shared/data/eval \\
        --out-dir runs/levers --limit 8 --json levers.json

On two shared CPU cores a variant at ``--tokens 2048 --batch-size 4 --limit 4`` (3 stage-1 steps, 1 stage-2 step)
takes 2 to 12 minutes with its scoring, depending on the other load (benchmarks/results/2026-12-07/levers_cpu.md).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's retrofit, whatever is installed

SELECTOR_LAYERS = "2-6,8-13,15,16,19,20,22,24-29"  # kda-22of30's layers (H200 ranking of 2026-12-02)
MAX_RUN_LAYERS = "1,3-6,8,9,11-13,15,16,18-20,22-25,27-29"  # the same ranking, select: max_run: 4
WINDOW = {"layer_spec": {"window": 64, "sink_tokens": 4}}
BLOCKS = {"stage1_target": "block"}
COSINE = {"kl_weight": 0.2, "ce_weight": 0.2, "hidden_cosine_weight": 0.6}
WHOLE = {"lora_targets": "attention,mlp,norms", "finetune_converted_blocks": True}
VARIANTS: dict[str, dict] = {
    "baseline": {},
    "window 64 + 4 sinks": WINDOW,
    "block alignment": BLOCKS,
    "0.2 KL + 0.2 CE + 0.6 cosine": COSINE,
    "norms + whole converted blocks": WHOLE,
    "window + blocks + cosine + whole": {**WINDOW, **BLOCKS, **COSINE, **WHOLE},
    "max_run 4 layers": {"layers": MAX_RUN_LAYERS},
    "window + blocks + cosine": {**WINDOW, **BLOCKS, **COSINE},
    "window + cosine": {**WINDOW, **COSINE},
    "window + cosine + whole": {**WINDOW, **COSINE, **WHOLE},
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


@torch.no_grad()
def scores(model, dense_logprobs: list[torch.Tensor], windows: torch.Tensor) -> tuple[float, float]:
    """(perplexity, mean per-token KL(dense || model)) of ``model`` on ``windows [N, T]``, one window at a time;
    ``dense_logprobs``: the dense model's log-probabilities ``[T - 1, vocab]`` per window."""
    nll = kl = 0.0
    for window, dense in zip(windows, dense_logprobs):
        logprobs = F.log_softmax(model(input_ids=window[None], use_cache=False).logits[0, :-1].float(), -1)
        nll += float(F.nll_loss(logprobs, window[1:], reduction="sum"))
        kl += float(F.kl_div(logprobs, dense, log_target=True, reduction="sum"))
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    return math.exp(nll / tokens), kl / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="calibration folder (../shared/data/calib)")
    parser.add_argument("--eval-data", required=True, help="evaluation folder holding wikitext2_test.raw")
    parser.add_argument("--out-dir", required=True, help="where the hybrids go (one folder per variant; kept)")
    parser.add_argument("--tokens", type=int, default=20480, help="calibration tokens of every variant")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="windows a step (default: the recipe's 8); fewer: more steps on the same tokens")
    parser.add_argument("--to", default="kda", help="layer type: gdn or kda")
    parser.add_argument("--limit", type=int, default=8, help="wikitext2 windows of 1,024 tokens scored")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of the variants to run")
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()

    import retrofit
    from retrofit.convert.pipeline import convert
    from retrofit.eval.perplexity import read_text, token_windows
    from retrofit.load import load

    print(f"retrofit from {Path(retrofit.__file__).parent}", flush=True)

    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    dense, tokenizer = load("smollm2-135m", dtype="float32")
    windows = token_windows(tokenizer, read_text(Path(args.eval_data) / "wikitext2_test.raw"), 1024, args.limit)
    with torch.no_grad():
        dense_logprobs = [F.log_softmax(dense(input_ids=w[None], use_cache=False).logits[0, :-1].float(), -1)
                          for w in windows]
    dense_ppl, _ = scores(dense, dense_logprobs, windows)
    rows = [{"variant": "dense", "ppl": dense_ppl, "kl": 0.0}]
    for name in names:
        out = Path(args.out_dir) / slug(name)
        settings = {"to": args.to, "layers": SELECTOR_LAYERS, "tokens": args.tokens, **VARIANTS[name]}
        if args.batch_size:
            settings["batch_size"] = args.batch_size
        began = time.perf_counter()
        convert((dense, tokenizer), recipe="smollm2-135m/cpu-small", data=[args.data], out=out, overwrite=True,
                show_progress=False, checkpoint_every=0, **settings)  # no resumable checkpoints: a bench
        minutes = (time.perf_counter() - began) / 60
        hybrid, _ = load(str(out), dtype="float32")
        section = json.loads((out / "config.json").read_text())["retrofit"]
        ppl, kl = scores(hybrid, dense_logprobs, windows)
        rows.append({"variant": name, "settings": settings, "ppl": ppl, "kl": kl, "minutes": minutes,
                     "stage1_last": section["distillation"]["final_loss_stage1"],
                     "stage2_mean_last20": section["distillation"]["mean_loss_stage2_last20"],
                     "tokens_trained": section["distillation"]["tokens_trained"]})
        print(json.dumps(rows[-1]), flush=True)
        del hybrid
        if args.json:  # after every variant: a run stopped early keeps the rows it finished
            Path(args.json).write_text(json.dumps({"rows": rows, "limit": args.limit, "tokens": args.tokens,
                                                   "batch_size": args.batch_size or 8}, indent=1))
    print(f"\n| variant ({args.to}, 22 of 30, {args.tokens:,} tokens) | wikitext2 ppl, {args.limit} x 1,024 | ratio to "
          "dense | KL(dense ‖ hybrid) nats/token | stage-2 loss (mean of last steps) | convert (min) |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        if row["variant"] == "dense":
            print(f"| dense | {row['ppl']:.2f} | 1.00x | - | - | - |")
            continue
        print(f"| {row['variant']} | {row['ppl']:.2f} | {row['ppl'] / dense_ppl:.2f}x | {row['kl']:.3f} | "
              f"{row['stage2_mean_last20']:.4f} | {row['minutes']:.1f} |")


if __name__ == "__main__":
    main()
