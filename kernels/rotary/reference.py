"""Pure-PyTorch rotary position embedding of one decode token's queries and keys, optionally writing the rotated key
and the value into a static KV cache: the specification the Triton kernel is tested against.

The rotation is transformers' ``apply_rotary_pos_emb`` (the "rotate half" convention of Llama, Mistral, Qwen2):
``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``, each product and the sum
rounded to the dtype of ``x`` as the model computes them. Conventions:

- one token per row: ``q [B, Hq, D]``, ``k, v [B, Hkv, D]``; ``cos, sin [B, D]`` or transformers' ``[B, 1, D]``
  (B rows, or 1 that serves every row);
- a static cache ``key_cache, value_cache [B, Hkv, N, D]``; ``length`` (int, one element or ``[B]``) is the cache's
  length *counting the new token*: the token goes to position ``length - 1`` of each row.
"""
from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rows = cos.shape[0]
    cos = cos.reshape(rows, 1, cos.shape[-1]).to(x.dtype)
    sin = sin.reshape(rows, 1, sin.shape[-1]).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def rotary_qk_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], k [B, Hkv, D], cos/sin [B, D] or [B, 1, D] -> (rotated q [B, Hq, D], rotated k [B, Hkv, D])."""
    return _rotated(q, cos, sin), _rotated(k, cos, sin)


def rotary_qk_into_cache_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             key_cache: torch.Tensor, value_cache: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Rotate q and k; write the rotated k and v ``[B, Hkv, D]`` at position ``length - 1`` of each row of
    ``key_cache``/``value_cache [B, Hkv, N, D]`` (in place) -> rotated q ``[B, Hq, D]``."""
    q_rotated, k_rotated = rotary_qk_ref(q, k, cos, sin)
    B, Hkv = k.shape[:2]
    rows = torch.arange(B, device=k.device)[:, None]
    heads = torch.arange(Hkv, device=k.device)[None, :]
    slot = (length.reshape(-1).long() - 1).expand(B)[:, None]
    key_cache[rows, heads, slot] = k_rotated.to(key_cache.dtype)
    value_cache[rows, heads, slot] = v.to(value_cache.dtype)
    return q_rotated
