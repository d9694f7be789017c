#!/usr/bin/env bash
# The GPU run of retrofit's decode engine (BENCHMARKS.md, "Current figures > End-to-end generation"):
#   bash benchmarks/decode_engine_gpu.sh OUT_DIR
# 1. the GPU tests of the engine: captured step = eager tokens, no allocation on replay, one graph launch per token,
#    and the real SmolLM2's greedy tokens equal transformers' (dense, Quest at a budget >= context, a GDN hybrid);
# 2. launches and host syncs per decode token (tiny 32-layer Llama); where the GPU time of a dense step goes (kernel
#    time per token at Llama-3-8B shapes, and the parts: merged projections, the attention's launch choices);
# 3. retrofit bench at Llama-3-8B shapes, each engine (rows that do not fit in memory are recorded as such).
# 127k, not 128k: the config's 131072 positions must hold the prompt and the new tokens.
set -euo pipefail
OUT=${1:?usage: decode_engine_gpu.sh OUT_DIR}
mkdir -p "$OUT"
# the GPU tests read the evaluation and calibration data: refuse at once where they would fail one by one
if [ -z "${RETROFIT_SHARED_DATA:-}" ] && [ ! -d ../shared/data ]; then
  echo "decode_engine_gpu.sh: no ../shared/data here; set RETROFIT_SHARED_DATA to the folder holding eval/ and calib/" >&2
  exit 2
fi
python -m pytest -q -m gpu tests/test_generation_gpu.py tests/test_bench.py 2>&1 | tee "$OUT/gpu_tests.log"
python benchmarks/decode_overhead.py --device cuda --json "$OUT/decode_overhead_cuda.json" | tee "$OUT/decode_overhead_cuda.md"
python benchmarks/decode_kernel_time.py --context 4096 --batch 1 --json "$OUT/kernel_time_4k_b1.json" | tee "$OUT/kernel_time_4k_b1.md"
python benchmarks/decode_parts.py --json "$OUT/decode_parts.json" | tee "$OUT/decode_parts.md"
for engine in retrofit retrofit-unfused transformers transformers-compile; do
  retrofit bench llama3-8b --context 4k,32k,127k --batch 1,8 --device cuda --dtype bfloat16 \
    --variant quest:budget=2048 --variant clusterkv:budget=2048 --variant seer:budget=2048,random_gates=true \
    --variant streaming:budget=2048 --variant convert:gdn:not:every:4 --variant convert:kda:not:every:4 \
    --variant "convert:gdn:not:every:4+quest:budget=2048" --engine "$engine" --json "$OUT/bench_$engine.json" \
    | tee "$OUT/bench_$engine.md"
done
