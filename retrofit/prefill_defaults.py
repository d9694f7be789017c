"""The default of sparse prefill's dense fallback, apart from :mod:`retrofit.sparse.prefill` so that the command line
can print it in ``--help`` without importing torch or transformers."""

# Prefill calls over fewer keys than this run dense attention (PrefillMethod.min_length's default). Measured on an H100
# (2026-12-07, `retrofit bench llama3-8b --context ... --batch 1 --variant prefill:xattention:max_density=0.1,
# min_length=0`, bf16, XAttention's fused estimate): the sparse prefill's speed against dense was 0.77x / 0.89x at
# 4K / 8K and 1.07x / 1.33x / 1.78x / 2.37x at 16K / 32K / 64K / 127K with no row in full, then 1.03x at 32K and
# 1.81x at 127K with every 4,096-token chunk's last query block in full (13.6% and 13.0% of the blocks instead of
# 10.4% and 10.1%). 32K is the shortest length measured to win with a row in full. Not timed yet: only the prompt's
# last chunk keeping its last row in full, and the kernel's longest-rows-first launch (both 2026-12-07).
# The default, the CLI help (MIN_LENGTH_HELP) and the tests all read it here: change it here only.
DEFAULT_MIN_LENGTH = 32768
MIN_LENGTH_HELP = (f"calls over fewer keys than min_length (default {DEFAULT_MIN_LENGTH}, where it paid on an H100) "
                   "run dense")
