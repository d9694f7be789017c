"""Shared machinery of the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

``reference``: pure-PyTorch recurrences and the float64 chunked specification.
``chunk``: the chunked Triton kernels (forward and backward) behind ``chunk_gated_delta_rule``
and ``chunk_kda``.
"""
