"""Greedy tokens of retrofit's engine beside transformers' ``generate`` on a packaged real model (BENCHMARKS.md,
"Architectures"): dense, Quest at a budget covering the context, and a hybrid with every ``--every``-th layer
converted (initialised from the attention weights, not distilled: equality of the two engines holds for any weights).

    python benchmarks/real_model_tokens.py ALIAS [--device cuda] [--dtype float32] [--new-tokens 64] \
        [--prompt-tokens 1000] [--calib DIR]

Prints one line per path: how many of the new tokens agree, and the first position where they part. On a GPU the two
engines add in different orders (graph-captured Triton kernels against cuBLAS/SDPA), so float32 tokens can part
where two logits are within rounding; the line says the logit gap at the first difference to tell that apart from a
wrong path.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import retrofit
from retrofit.architecture import base_model_type
from retrofit.convert.build import to_hybrid
from retrofit.hybrid import HybridSection
from retrofit.sparse import sparse_decoding


def greedy_reference(model, ids, new_tokens, pad_id):
    """transformers' greedy generate: ``[1, T + new_tokens]``."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              top_p=None, top_k=None, pad_token_id=pad_id)


def compare(name, model, ours, reference, prompt_tokens):
    """One result row: agreeing new tokens, first differing position and the reference's top-2 logit gap there."""
    new_ours, new_ref = ours[0, prompt_tokens:], reference[0, prompt_tokens:]
    differ = (new_ours != new_ref).nonzero()
    first = int(differ[0]) if len(differ) else None
    gap = None
    if first is not None:
        with torch.no_grad():
            logits = model(reference[:, :prompt_tokens + first]).logits[0, -1].float()
        top = logits.topk(2).values
        gap = float(top[0] - top[1])
    row = {"path": name, "new_tokens": len(new_ref), "equal": int((new_ours == new_ref).sum()), "first_difference": first,
           "top2_logit_gap_there": gap}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("alias")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--every", type=int, default=4, help="convert layers every-1, 2*every-1, ... in the hybrid")
    parser.add_argument("--calib", type=Path, default=Path("../shared/data/calib"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    model, tokenizer = retrofit.load(args.alias, dtype=args.dtype, device=args.device)
    text = (args.calib / "frankenstein.txt").read_text(encoding="utf-8")[20_000:60_000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.prompt_tokens].to(args.device)
    mask = torch.ones_like(ids)
    rows = []
    reference = greedy_reference(model, ids, args.new_tokens, tokenizer.pad_token_id)
    rows.append(compare("dense", model, retrofit.generate(model, ids, mask, max_new_tokens=args.new_tokens), reference,
                        ids.shape[1]))
    budget = 1 << (ids.shape[1] + args.new_tokens).bit_length()
    with sparse_decoding(model, method="quest", budget=budget, dense_layers=()):
        tokens = retrofit.generate(model, ids, mask, max_new_tokens=args.new_tokens)
    rows.append(compare(f"quest@{budget}", model, tokens, reference, ids.shape[1]))
    for layer_type in ("gdn", "kda"):
        layers = list(range(args.every - 1, model.config.num_hidden_layers, args.every))
        hybrid = to_hybrid(model, HybridSection(layers=layers, layer_type=layer_type,
                                                base_model_type=base_model_type(model.config))).eval()
        hybrid_reference = greedy_reference(hybrid, ids, args.new_tokens, tokenizer.pad_token_id)
        tokens = retrofit.generate(hybrid, ids, mask, max_new_tokens=args.new_tokens)
        rows.append(compare(f"{layer_type} hybrid, layers {layers}", hybrid, tokens, hybrid_reference, ids.shape[1]))
        del hybrid
    if args.json:
        args.json.write_text(json.dumps({"alias": args.alias, "device": torch.cuda.get_device_name()
                                         if args.device.startswith("cuda") else "cpu", "dtype": args.dtype,
                                         "prompt_tokens": int(ids.shape[1]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
