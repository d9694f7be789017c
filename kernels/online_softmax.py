"""Flash attention's online softmax (fp32, exp2 domain): one key tile folded into the running maximum, normaliser and
weighted sum of values. Shared by the sparse decode and sparse prefill kernels, which differ only in which keys a
tile holds."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """s [R, N]: a tile's logits already scaled to the exp2 domain, -inf where a key is hidden; v [N, D]: its values;
    m_i, l_i [R] and acc [R, D]: the running maximum, normaliser and sum (fp32) -> the three updated. A row with every
    key hidden so far keeps m = -inf, l = 0 and acc = 0 (no NaN). ``IEEE``: full-fp32 dots (the interpreter's and the
    float32 tests' path); otherwise p is cast to the values' dtype for the tensor cores."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
