#!/usr/bin/env bash
# Issue #5's accuracy table on the GPU: SeerAttention gates trained on calibration text, then dense vs every sparse
# method at budgets 256 and 1024 on passkey / niah_single / vt, 20 seeds (one item each). Quest runs at the authors'
# page size 16 and at 8 (this model's head_dim is 64: its page bound is looser than on the authors' 128).
# One eval per context length, all lengths at once spread over the visible GPUs (a 135M model leaves a GPU mostly
# idle); each length keeps its JSON even if another runs out of time.
#
#   bash benchmarks/sparse_accuracy_gpu.sh MODEL CALIB_DIR [CONTEXTS]
#     MODEL      smollm2-135m (alias) or a model / hybrid directory
#     CALIB_DIR  calibration text for the gates (../shared/data/calib)
#     CONTEXTS   space-separated prompt lengths (default "2048 4096 8000")
#   GATE_TOKENS / GATE_SEQ_LEN: gate training (default 1048576 tokens in sequences of 2048, the last 64 positions
#   of each as decode queries, half the sequences ending in a repeated span: `retrofit gates --retrieval-fraction`);
#   PARALLEL=0 runs the lengths one after another.
# Results: $OUT/gates.log, $OUT/sparse_eval_CTX.json (+ .log) and the printed tables (OUT defaults to ./out).
set -euo pipefail
model=${1:?MODEL}
calib=${2:?CALIB_DIR}
contexts=${3:-2048 4096 8000}
out=${OUT:-out}
mkdir -p "$out"
gates="$out/seer.gates"
[ -f "$gates" ] || retrofit gates "$model" --data "$calib" --tokens "${GATE_TOKENS:-1048576}" \
  --seq-len "${GATE_SEQ_LEN:-2048}" --queries 64 --out "$gates" --device cuda --dtype bfloat16 2>&1 \
  | tr '\r' '\n' | grep -v "%|" | tail -3 | tee "$out/gates.log"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$gpus" -ge 1 ] || gpus=1
i=0
for ctx in $contexts; do
  CUDA_VISIBLE_DEVICES=$(( i % gpus )) retrofit eval "$model" --tasks passkey,niah_single,vt --context-length "$ctx" \
    --limit 1 --num-seeds 20 --batch-size 20 --device cuda --sparse streaming --sparse quest --sparse clusterkv \
    --sparse retrieval --budget 256 --budget 1024 --variant "quest:budget=256,page_size=8" \
    --variant "quest:budget=1024,page_size=8" --variant "seer:budget=256,gate_path=$gates" \
    --variant "seer:budget=1024,gate_path=$gates" --json "$out/sparse_eval_$ctx.json" 2>&1 \
    | tr "\r" "\n" | grep -v "%|" > "$out/sparse_eval_$ctx.log" &
  i=$(( i + 1 ))
  [ "${PARALLEL:-1}" = 1 ] || wait
done
wait
for ctx in $contexts; do echo "== context $ctx"; cat "$out/sparse_eval_$ctx.log"; done
