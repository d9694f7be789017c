#!/usr/bin/env bash
# The GPU run of the architecture work and of the conversion memory plan (BENCHMARKS.md, "Conversion at 7-8B scale"
# and "Architectures"):
#   bash benchmarks/architectures_gpu.sh OUT_DIR [steps]
# 1. the GPU tests of the new paths: every zoo architecture's tokens through the engine on CUDA (graph-captured
#    decode, Triton kernels, fused layers where the family has them, rings for sliding windows) equal transformers';
#    the sparse-decode kernel's bf16 numerics with and without logit softcapping;
# 2. the distillation step at Llama-3-8B and Qwen2.5-7B shapes (random weights, bf16 frozen weights), 3 of 4 layers
#    to GDN and to KDA, stage 1 and stage 2 at 1K/4K/8K windows, 16K tokens a step: ms/step, tokens/s, peak memory
#    beside the memory plan's, MFU;
# 3. retrofit bench at Qwen2.5-7B shapes, 4K x 1: dense against the bytes floor, and Quest at 2,048.
set -uo pipefail
OUT=${1:?usage: architectures_gpu.sh OUT_DIR [steps]}
STEPS=${2:-4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python -m pytest -q -m gpu tests/test_architecture_generation.py tests/kernel_ops/test_sparse_decode.py \
  -k "cuda or bf16_gpu" 2>&1 | tee "$OUT/gpu_tests.log"
for model in ${MODELS:-llama3-8b qwen2.5-7b}; do
  for kind in gdn kda; do
    python benchmarks/distill_step.py --device cuda --model "$model" --layer-type "$kind" --windows 1024,4096,8192 \
      --batch-size 8 --grad-accum 2 --warmup 2 --steps "$STEPS" --json "$OUT/distill_${model}_${kind}.json" \
      2>&1 | tee "$OUT/distill_${model}_${kind}.md"
  done
done
python -m retrofit bench qwen2.5-7b --context 4k --batch 1 --device cuda --dtype bfloat16 --variant quest:budget=2048 \
  --repeats 3 --json "$OUT/bench_qwen25_7b.json" 2>&1 | tee "$OUT/bench_qwen25_7b.md"
