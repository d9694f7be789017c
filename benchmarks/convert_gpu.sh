#!/usr/bin/env bash
# Conversion on the GPU (BENCHMARKS.md, Conversion): distil one hybrid of the reference model from a recipe, then
# evaluate it beside the dense model (float32: wikitext2 first 32 windows of 1024; PIQA and ARC-easy first 200 items)
# and check that sparse decoding on its remaining softmax layers at budget >= context equals the hybrid alone.
#
#   bash benchmarks/convert_gpu.sh RECIPE OUT_DIR CALIB_DIR EVAL_DIR [MAX_MINUTES] [extra convert options...]
#     RECIPE       e.g. smollm2-135m/kda-8of30-50m-b16
#     OUT_DIR      where the hybrid checkpoint goes; a paused run (exit 3) resumes when called again
#     MAX_MINUTES  checkpoint and stop after this many minutes of training (default 8)
# Logs and JSON land in $OUT (default ./out) under the checkpoint's name.
set -uo pipefail
recipe=${1:?RECIPE}; hyb=${2:?OUT_DIR}; calib=${3:?CALIB_DIR}; evaldir=${4:?EVAL_DIR}; minutes=${5:-8}
shift $(( $# < 5 ? $# : 5 ))
out=${OUT:-out}
name=$(basename "$hyb")
mkdir -p "$out"
resume=()
[ -d "$hyb.train" ] && resume=(--resume)
if [ ! -f "$hyb/config.json" ]; then
  start=$(date +%s)
  # --no-report: the evaluations below are the BENCHMARKS.md protocol (the conversion report would add its own)
  retrofit convert smollm2-135m --recipe "$recipe" --data "$calib" --out "$hyb" --device cuda --no-report \
    --max-minutes "$minutes" "${resume[@]}" "$@" 2>&1 | tr '\r' '\n' | grep -v "%|" | tee "$out/convert_$name.log"
  code=${PIPESTATUS[0]}
  echo "convert exit $code after $(( $(date +%s) - start )) s" | tee -a "$out/convert_$name.log"
  [ "$code" = 0 ] || exit "$code"
fi
# each evaluation is skipped when its JSON exists (a resumed call picks up where the last one stopped)
[ -f "$out/ppl_$name.json" ] || retrofit eval smollm2-135m --hybrid "$hyb" --tasks wikitext2 --limit 32 --seq-len 1024 --data-dir "$evaldir" \
  --device cuda --dtype float32 --batch-size 8 --json "$out/ppl_$name.json" 2>&1 | tr '\r' '\n' | grep -v "%|"
[ -f "$out/mc_$name.json" ] || retrofit eval smollm2-135m --hybrid "$hyb" --tasks piqa,arc_easy --limit 200 --data-dir "$evaldir" \
  --device cuda --dtype float32 --batch-size 32 --json "$out/mc_$name.json" 2>&1 | tr '\r' '\n' | grep -v "%|"
# sparse decoding on the hybrid's softmax layers: budget 4096 >= context 2048 must equal the hybrid alone
[ -f "$out/sparse_$name.json" ] || retrofit eval "$hyb" --tasks passkey,niah_single --context-length 2048 --limit 1 --num-seeds 10 --batch-size 10 \
  --device cuda --sparse quest --budget 1024 --budget 4096 --json "$out/sparse_$name.json" 2>&1 \
  | tr '\r' '\n' | grep -v "%|"
