"""Shared machinery of the gated delta rule (GDN, scalar decay) and KDA (per-channel decay).

``reference``: pure-PyTorch recurrences and the float64 chunked specification.
``chunk``: the host side (launches, autograd, validation) of the chunked Triton kernels in ``chunk_fwd_kernels`` and
``chunk_bwd_kernels`` (helpers in ``chunk_common``), behind ``chunk_gated_delta_rule``
and ``chunk_kda``.
"""
