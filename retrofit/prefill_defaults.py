"""The default of sparse prefill's dense fallback, apart from :mod:`retrofit.sparse.prefill` so that the command line
can print it in ``--help`` without importing torch or transformers."""

# Prefill calls over fewer keys than this run dense attention (PrefillMethod.min_length's default). Measured on an H100
# (2026-12-07, `retrofit bench llama3-8b --context 4k,8k,16k,32k,64k,127k --batch 1 --variant
# prefill:xattention:max_density=0.1,min_length=0`, bf16, 10-18% of the blocks computed, XAttention's fused estimate):
# the sparse prefill's speed against dense was 0.77x / 0.89x at 4K / 8K and 1.07x / 1.33x / 1.78x / 2.37x at 16K /
# 32K / 64K / 127K; this is the shortest length it won at (the longest it lost at: 8,192).
# The default, the CLI help (MIN_LENGTH_HELP) and the tests all read it here: change it here only.
DEFAULT_MIN_LENGTH = 16384
MIN_LENGTH_HELP = (f"calls over fewer keys than min_length (default {DEFAULT_MIN_LENGTH}, where it paid on an H100) "
                   "run dense")
