#!/usr/bin/env bash
# Issue #5's accuracy table on the GPU: SeerAttention gates trained on calibration text, then dense vs every sparse
# method at budgets 256 and 1024 on passkey / niah_single / vt, 20 seeds (one item each), one eval per context length
# so that each finished length keeps its JSON even if a later one runs out of time.
#
#   bash benchmarks/sparse_accuracy_gpu.sh MODEL CALIB_DIR [CONTEXTS]
#     MODEL      smollm2-135m (alias) or a model / hybrid directory
#     CALIB_DIR  calibration text for the gates (../shared/data/calib)
#     CONTEXTS   space-separated prompt lengths (default "2048 4096 8000")
# Results: $OUT/gates.log, $OUT/sparse_eval_CTX.json and the printed tables (OUT defaults to ./out).
set -euo pipefail
model=${1:?MODEL}
calib=${2:?CALIB_DIR}
contexts=${3:-2048 4096 8000}
out=${OUT:-out}
mkdir -p "$out"
gates="$out/seer.gates"
[ -f "$gates" ] || retrofit gates "$model" --data "$calib" --tokens 262144 --out "$gates" --device cuda \
  --dtype bfloat16 2>&1 | tr '\r' '\n' | grep -v "%|" | tail -3
for ctx in $contexts; do
  retrofit eval "$model" --tasks passkey,niah_single,vt --context-length "$ctx" --limit 1 --num-seeds 20 \
    --batch-size 20 --device cuda --sparse streaming --sparse quest --sparse clusterkv --sparse retrieval \
    --budget 256 --budget 1024 --variant "seer:budget=256,gate_path=$gates" \
    --variant "seer:budget=1024,gate_path=$gates" --json "$out/sparse_eval_$ctx.json" 2>&1 \
    | tr "\r" "\n" | grep -v "%|"
done
