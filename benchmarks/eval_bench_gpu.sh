#!/usr/bin/env bash
# GPU run of the evaluation instrument: reference accuracies of SmolLM2 on the H200 and the speed /
# memory sweep of a Llama-3-8B-shaped model. One command; results land in $OUT (default ./out).
#
#   bash benchmarks/eval_bench_gpu.sh MODEL DATA_DIR
#     MODEL     the reference model (smollm2-135m alias, or /root/ref/SmolLM2-135M-Instruct.Q4_1.gguf)
#     DATA_DIR  the folder with wikitext2_test.raw, piqa.jsonl, arc_easy.jsonl, ... (/root/ref/data/eval)
set -euo pipefail
model=${1:?MODEL}
data=${2:?DATA_DIR}
out=${OUT:-out}
mkdir -p "$out"
# float32 wikitext2 reference: 32 windows of 1024 -> 23.94 (design/evaluation.md)
retrofit eval "$model" --tasks wikitext2 --limit 32 --seq-len 1024 --data-dir "$data" --device cuda \
  --dtype float32 --batch-size 8 --json "$out/eval_ppl_fp32.json"
# multiple choice, first 200 items (expected: PIQA 0.625, ARC-easy 0.450 acc)
retrofit eval "$model" --tasks piqa,arc_easy,hellaswag,lambada --limit 200 --data-dir "$data" --device cuda \
  --dtype float32 --batch-size 32 --json "$out/eval_mc200_fp32.json"
# long-context synthetic sweep (SmolLM2 has 8192 positions)
retrofit eval "$model" --tasks niah_single,niah_multikey,niah_multivalue,vt,cwe,fwe,passkey \
  --context-length 1k,2k,4k,8k --limit 20 --device cuda --dtype bfloat16 --batch-size 20 \
  --json "$out/eval_ruler_bf16.json" --plot "$out/eval_ruler_bf16.png"
# speed and memory at scale, random weights in the real Llama-3-8B shapes
retrofit bench llama3-8b --context 4k,32k --batch 1,8 --device cuda --dtype bfloat16 --json "$out/bench_llama3.json"
