"""Rotary embedding of one decode token's q and k in one launch, optionally writing k and v into a static KV cache:
Triton kernel and PyTorch reference."""

from .reference import rotary_qk_into_cache_ref, rotary_qk_ref
from .rotary import rotary_qk, rotary_qk_into_cache

__all__ = ["rotary_qk", "rotary_qk_into_cache", "rotary_qk_into_cache_ref", "rotary_qk_ref"]
