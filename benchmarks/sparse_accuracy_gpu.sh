#!/usr/bin/env bash
# The sparse-decoding accuracy table on the GPU (BENCHMARKS.md, Sparse decoding: accuracy): SeerAttention gates
# trained on calibration text, then dense vs every sparse method at budgets 256 and 1024 on passkey / niah_single / vt,
# 20 seeds (one item each). Quest runs at the authors'
# page size 16 and at 8 and 4 (this model's head_dim is 64: its page bound is looser than on the authors' 128; on the
# CPU, niah_single@4096 at budget 1024 kept 40% / 60% / 100% of dense at pages 16 / 8 / 4).
# Each context length runs as three evaluations at once (a 135M model leaves a GPU mostly idle; each has the dense
# column): "main" (streaming, quest, clusterkv), "retrieval" (faiss on the host, the slowest) and "seer" (starts
# when the gates are trained). All of them spread over the visible GPUs, or over GPUS="0 1" if set. An evaluation
# whose JSON exists is skipped, so a run cut by a time limit resumes where it stopped.
#
#   bash benchmarks/sparse_accuracy_gpu.sh MODEL CALIB_DIR [CONTEXTS]
#     MODEL      smollm2-135m (alias) or a model / hybrid directory
#     CALIB_DIR  calibration text for the gates (../shared/data/calib)
#     CONTEXTS   space-separated prompt lengths (default "2048 4096 8000")
#   GATE_TOKENS / GATE_SEQ_LEN / GATE_MIN_SEQ_LEN: gate training (default 1048576 tokens in sequences of 2048, or of
#   lengths drawn between GATE_MIN_SEQ_LEN and GATE_SEQ_LEN, each starting at a random position; the last 64
#   positions of each as decode queries, half the sequences ending in a repeated span: `retrofit gates`);
#   GATE_BLOCK_SIZE: tokens per gated block (default 64, the authors'; decode queries per sequence: min(64, it)).
# Results: $OUT/gates.log, $OUT/sparse_eval_CTX_{main,retrieval,seer}.json (+ .log) and the printed tables.
set -euo pipefail
model=${1:?MODEL}
calib=${2:?CALIB_DIR}
contexts=${3:-2048 4096 8000}
out=${OUT:-out}
mkdir -p "$out"
gates="$out/seer.gates"
gpus=(${GPUS:-$(seq 0 $(( $(nvidia-smi -L 2>/dev/null | wc -l) - 1 )))})
[ ${#gpus[@]} -ge 1 ] || gpus=(0)
declare -A variants=(
  [main]="--sparse streaming --sparse quest --sparse clusterkv --budget 256 --budget 1024
          --variant quest:budget=256,page_size=8 --variant quest:budget=1024,page_size=8
          --variant quest:budget=256,page_size=4 --variant quest:budget=1024,page_size=4"
  [retrieval]="--sparse retrieval --budget 256 --budget 1024"
  [seer]="--variant seer:budget=256,gate_path=$gates --variant seer:budget=1024,gate_path=$gates"
)
slot=0
evaluate() {  # context part
  local ctx=$1 part=$2 gpu=${gpus[$(( slot % ${#gpus[@]} ))]}
  slot=$(( slot + 1 ))
  [ -f "$out/sparse_eval_${ctx}_$part.json" ] && return 0
  # shellcheck disable=SC2086  # the variant options are meant to split into words
  CUDA_VISIBLE_DEVICES=$gpu retrofit eval "$model" --tasks passkey,niah_single,vt --context-length "$ctx" \
    --limit 1 --num-seeds 20 --batch-size 20 --device cuda ${variants[$part]} \
    --json "$out/sparse_eval_${ctx}_$part.json" 2>&1 | tr "\r" "\n" | grep -v "%|" > "$out/sparse_eval_${ctx}_$part.log" &
}
for ctx in $contexts; do evaluate "$ctx" main; evaluate "$ctx" retrieval; done
[ -f "$gates" ] || CUDA_VISIBLE_DEVICES=${gpus[0]} retrofit gates "$model" --data "$calib" \
  --tokens "${GATE_TOKENS:-1048576}" --seq-len "${GATE_SEQ_LEN:-2048}" --min-seq-len "${GATE_MIN_SEQ_LEN:-${GATE_SEQ_LEN:-2048}}" \
  --block-size "${GATE_BLOCK_SIZE:-64}" --queries "$(( ${GATE_BLOCK_SIZE:-64} < 64 ? ${GATE_BLOCK_SIZE:-64} : 64 ))" --out "$gates" --device cuda \
  --dtype bfloat16 2>&1 | tr '\r' '\n' | grep -v "%|" | tail -3 | tee "$out/gates.log"
for ctx in $contexts; do evaluate "$ctx" seer; done
wait
for ctx in $contexts; do
  for part in main retrieval seer; do echo "== context $ctx, $part"; cat "$out/sparse_eval_${ctx}_$part.log" 2>/dev/null; done
done
