"""Which implementation runs an op: its Triton kernel or its PyTorch path. Decided here, for every op, and nowhere else.

Every public op of ``retrofit.kernels`` (``chunk_kda``, ``causal_conv1d``, ``sparse_decode_attention``, ...) asks
:func:`implementation` for the function to run on its input's device. The choice, the *backend*, is

- ``auto`` (default): Triton on CUDA; the PyTorch path on any other device (Triton has only its slow interpreter
  there, ~20 ms per token and layer);
- ``triton``: the Triton kernel everywhere (on the CPU this needs ``TRITON_INTERPRET=1`` before triton is imported:
  how the kernel tests run on machines without a GPU);
- ``torch``: the PyTorch path everywhere.

It is set for a block with :func:`use_backend` (innermost wins) or for a process with ``RETROFIT_BACKEND``
(``RETROFIT_LINEAR_BACKEND`` is read too, its former name).

The PyTorch paths are the references the kernels are tested against (``reference.py`` beside each kernel); the table
:data:`OPS` names both implementations of every op, as ``module:function`` under this package, imported on first use.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from typing import Callable, Iterator

import torch

BACKENDS = ("auto", "triton", "torch")
ENVIRONMENT_VARIABLES = ("RETROFIT_BACKEND", "RETROFIT_LINEAR_BACKEND")

# op -> (Triton host function, PyTorch path); both take the same arguments.
OPS: dict[str, tuple[str, str]] = {
    "chunk_delta_rule": ("delta_common.chunk:chunk_delta_rule_triton", "delta_common.reference:chunk_delta_rule_torch"),
    "recurrent_delta_rule": ("gated_delta_rule.fused_recurrent:fused_recurrent_delta_rule",
                             "delta_common.reference:recurrent_delta_rule_torch"),
    "causal_conv1d": ("conv.causal_conv1d:causal_conv1d_triton", "conv.reference:naive_causal_conv1d"),
    "causal_conv1d_update": ("conv.causal_conv1d:causal_conv1d_update_triton", "conv.reference:naive_causal_conv1d_update"),
    "sparse_decode_attention": ("sparse_decode.attention:sparse_decode_attention_triton",
                                "sparse_decode.reference:sparse_decode_attention_ref"),
    "sparse_prefill_attention": ("sparse_prefill.attention:sparse_prefill_attention_triton",
                                 "sparse_prefill.reference:sparse_prefill_attention_ref"),
    "antidiagonal_block_mass": ("sparse_prefill.estimate:antidiagonal_block_mass_triton",
                                "sparse_prefill.reference:antidiagonal_block_mass_ref"),
    "quest_page_scores": ("sparse_decode.scoring:quest_page_scores_triton", "sparse_decode.reference:quest_page_scores_ref"),
    "cluster_scores": ("sparse_decode.scoring:cluster_scores_triton", "sparse_decode.reference:cluster_scores_ref"),
    "topk_indices": ("sparse_decode.topk:topk_indices_triton", "sparse_decode.reference:topk_indices_ref"),
    "block_topk": ("sparse_decode.topk:block_topk_triton", "sparse_decode.reference:block_topk_ref"),
    "quest_page_update": ("sparse_decode.newest_block:quest_page_update_triton",
                          "sparse_decode.reference:quest_page_update_ref"),
    "mask_positions": ("sparse_decode.compaction:mask_positions_triton", "sparse_decode.reference:mask_positions_ref"),
    "cluster_take": ("sparse_decode.cluster_mask:cluster_take_triton", "sparse_decode.reference:cluster_take_ref"),
    "cluster_token_mask": ("sparse_decode.cluster_mask:cluster_token_mask_triton",
                           "sparse_decode.reference:cluster_token_mask_ref"),
    "pool_newest_block": ("sparse_decode.newest_block:pool_newest_block_triton",
                          "sparse_decode.reference:pool_newest_block_ref"),
    "seer_gate_key_update": ("sparse_decode.newest_block:seer_gate_key_update_triton",
                             "sparse_decode.reference:seer_gate_key_update_ref"),
    "delta_rule_decode_step": ("gated_delta_rule.decode_step:delta_rule_decode_step_triton",
                               "delta_common.reference:delta_rule_decode_step_ref"),
    "sigmoid_gated_rms_norm": ("rms_norm.gated:sigmoid_gated_rms_norm_triton",
                               "rms_norm.reference:sigmoid_gated_rms_norm_ref"),
    "rms_norm": ("rms_norm.rms_norm:rms_norm_triton", "rms_norm.reference:rms_norm_ref"),
    "add_rms_norm": ("rms_norm.rms_norm:add_rms_norm_triton", "rms_norm.reference:add_rms_norm_ref"),
    "silu_mul": ("silu_mul.silu_mul:silu_mul_triton", "silu_mul.reference:silu_mul_ref"),
    "rotary_qk": ("rotary.rotary:rotary_qk_triton", "rotary.reference:rotary_qk_ref"),
    "rotary_qk_into_cache": ("rotary.rotary:rotary_qk_into_cache_triton", "rotary.reference:rotary_qk_into_cache_ref"),
}

_override: list[str] = []
_resolved: dict[str, Callable] = {}


def _check(name: str, origin: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{origin} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def requested() -> str:
    """The backend asked for: the innermost :func:`use_backend`, else the environment, else ``auto``."""
    if _override:
        return _override[-1]
    for variable in ENVIRONMENT_VARIABLES:
        if os.environ.get(variable):
            return _check(os.environ[variable], variable)
    return "auto"


def backend_for(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"``: what runs on ``device`` now (``auto`` resolved)."""
    choice = requested()
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return choice


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run every op inside the block on backend ``name`` (``auto``, ``triton`` or ``torch``)."""
    _override.append(_check(name, "backend"))
    try:
        yield
    finally:
        _override.pop()


def _load(target: str) -> Callable:
    if target not in _resolved:
        module, _, attribute = target.partition(":")
        _resolved[target] = getattr(importlib.import_module(f"{__package__}.{module}"), attribute)
    return _resolved[target]


def implementation(op: str, device: torch.device | str) -> Callable:
    """The function that runs ``op`` on ``device`` under the current backend (see the module docstring)."""
    triton_path, torch_path = OPS[op]
    return _load(triton_path if backend_for(device) == "triton" else torch_path)
