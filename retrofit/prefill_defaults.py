"""The default of sparse prefill's dense fallback, apart from :mod:`retrofit.sparse.prefill` so that the command line
can print it in ``--help`` without importing torch or transformers."""

# Prefill calls over fewer keys than this run dense attention (PrefillMethod.min_length's default). A placeholder, not
# a measurement: the length below which the sparse prefill (its estimate included) stops beating dense attention has
# not been timed yet. The default, the CLI help (MIN_LENGTH_HELP) and the tests all read it here: change it here only.
DEFAULT_MIN_LENGTH = 4096
MIN_LENGTH_HELP = (f"calls over fewer keys than min_length (default {DEFAULT_MIN_LENGTH}, a placeholder until "
                   "measured) run dense")
