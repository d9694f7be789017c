#!/usr/bin/env bash
# Long context on a real model with 32K positions (BENCHMARKS.md, "Long context"): dense, sparse decoding and
# hybrids, side by side, on the GPU. The model must be in RETROFIT_CACHE first (benchmarks/gpu_model_parts.sh).
#
#   bash benchmarks/long_context_gpu.sh dense ALIAS EVAL_DIR          # perplexity and multiple choice in full (fp32)
#   bash benchmarks/long_context_gpu.sh sparse ALIAS CALIB_DIR SEEDS  # passkey / niah at 8K-32K, dense beside every
#                                                                     # sparse method at budgets 1,024 and 2,048
#   bash benchmarks/long_context_gpu.sh bench ALIAS [HYBRID_DIR]      # decode at 8K and 32K, batch 1 and 8
# Hybrids: benchmarks/convert_long_gpu.sh convert-report with recipes/qwen2.5-0.5b/*.yaml and REPORT_CONTEXTS=8k,16k,32k.
set -uo pipefail
command -v retrofit >/dev/null || retrofit() { python -m retrofit "$@"; }  # a GPU machine with the wheels, no entry point
stage=${1:?dense|sparse|bench}
out=${OUT:-out}
mkdir -p "$out"
case "$stage" in
dense)
  alias=${2:?ALIAS}; evaldir=${3:?EVAL_DIR}
  retrofit eval "$alias" --tasks wikitext2,piqa,arc_easy,arc_challenge,hellaswag --data-dir "$evaldir" --device cuda \
    --dtype float32 --json "$out/dense_$alias.json" 2>&1 | tee "$out/dense_$alias.md"
  ;;
sparse)
  alias=${2:?ALIAS}; calib=${3:?CALIB_DIR}; seeds=${4:-20}
  retrofit gates "$alias" --data "$calib" --tokens 3145728 --seq-len 8192 --min-seq-len 2048 --block-size 64 \
    --queries 64 --out "$out/gates_$alias.pt" --device cuda --dtype bfloat16 2>&1 | tail -3
  retrofit eval "$alias" --tasks passkey,niah_single,niah_multikey --context-length 8k,16k,32k --num-seeds "$seeds" \
    --sparse streaming --sparse quest --sparse clusterkv --sparse retrieval --sparse seer \
    --sparse-arg gate_path="$out/gates_$alias.pt" --budget 1024 --budget 2048 --device cuda --dtype bfloat16 \
    --json "$out/sparse_$alias.json" 2>&1 | tee "$out/sparse_$alias.md"
  ;;
bench)
  alias=${2:?ALIAS}; hybrid=${3:-}
  variants=(--variant quest:budget=2048)
  if [ -n "$hybrid" ]; then variants+=(--hybrid "$hybrid" --variant "hybrid:$hybrid+quest:budget=2048"); fi
  retrofit bench "$alias" --context 8k,32k --batch 1,8 --device cuda --dtype bfloat16 "${variants[@]}" \
    --json "$out/bench_$alias.json" 2>&1 | tee "$out/bench_$alias.md"
  ;;
esac
