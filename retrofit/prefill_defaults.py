"""The default of sparse prefill's dense fallback, apart from :mod:`retrofit.sparse.prefill` so that the command line
can print it in ``--help`` without importing torch or transformers."""

# Prefill calls over fewer keys than this run dense attention (PrefillMethod.min_length's default). Measured on an H100
# (2026-12-07, `retrofit bench llama3-8b --batch 1 --variant prefill:xattention:max_density=0.1,min_length=0`, bf16,
# 10-13% of the blocks computed): the sparse prefill took longer than dense at 1K-32K (0.34x-0.90x dense's speed) and
# less at 127K (1.07x); this lies between the longest length it lost at and the shortest it won at. That was before
# the estimate's products moved to bf16 and its causal half: measure again and lower it where it then pays.
# The default, the CLI help (MIN_LENGTH_HELP) and the tests all read it here: change it here only.
DEFAULT_MIN_LENGTH = 65536
MIN_LENGTH_HELP = (f"calls over fewer keys than min_length (default {DEFAULT_MIN_LENGTH}, where it paid on an H100) "
                   "run dense")
