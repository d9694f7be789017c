"""Converted layers and conversion on CUDA: bf16 through the Triton kernels (run in GPU sessions: pytest -m gpu)."""
from __future__ import annotations

import pytest
import torch
from _testing import rel_rms
from transformers import DynamicCache

from retrofit.generation.inputs import cache_keyword
from retrofit.hybrid import load_hybrid
from retrofit.convert.pipeline import convert
from retrofit.layers import LAYER_TYPES, AttentionShape, LinearAttentionSpec
from retrofit.convert.init import init_from_attention
from retrofit.kernels import use_backend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_bf16_triton_layer_matches_fp32_torch_path(smollm2, kind):
    """Forward and parameter gradients of a layer on SmolLM2's weights: bf16 autocast + Triton chunk kernels on CUDA
    against the float32 PyTorch chunked form."""
    model, _ = smollm2
    torch.manual_seed(0)
    x = torch.randn(4, 300, model.config.hidden_size) * 0.5
    results = {}
    for name, device, backend, bf16 in (("ref", "cpu", "torch", False), ("fast", "cuda", "triton", True)):
        layer = LAYER_TYPES.get(kind)(AttentionShape.from_config(model.config), 7, LinearAttentionSpec())
        init_from_attention(layer, model.model.layers[7].self_attn)
        layer = layer.to(device).train()
        with use_backend(backend), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = layer(x.to(device))[0]
        out.float().pow(2).mean().backward()
        results[name] = (out.detach().cpu(), {n: p.grad.cpu() for n, p in layer.named_parameters() if p.grad is not None})
    # bf16 inputs with fp32 accumulation: FLA accepts ~5e-3 relative RMS on outputs, ~2e-2 on gradients
    assert rel_rms(results["fast"][0], results["ref"][0]) < 1e-2
    errors = {n: rel_rms(results["fast"][1][n], g) for n, g in results["ref"][1].items()}
    assert all(error < 5e-2 for error in errors.values()), errors  # every parameter's error, not the first only


def test_gpu_conversion_decodes_like_full_forward(smollm2, calib_data_dir, tmp_path):
    """A short conversion on CUDA (bf16 autocast, Triton chunk kernels in training) gives a hybrid whose fp32
    prefill + recurrent decode on CUDA equals its full forward (max abs logit diff < 1e-3)."""
    out = tmp_path / "gpu-hybrid"
    convert(smollm2, recipe="smollm2-135m/cpu-small", data=[str(calib_data_dir)], out=out, tokens=65536,
            seq_len=256, batch_size=8, device="cuda", show_progress=False)
    model = load_hybrid(out, device="cuda")
    ids = torch.randint(0, 49000, (2, 90), device="cuda")
    with torch.no_grad():
        full = model(ids).logits
        cache = {cache_keyword(model): DynamicCache(config=model.config)}  # `cache` from transformers 5.2x
        pieces = [model(ids[:, :70], use_cache=True, **cache).logits]
        for t in range(70, 90):
            pieces.append(model(ids[:, t:t + 1], use_cache=True, **cache).logits)
    # fp32 (tf32 off by default in torch matmuls); the task's bar is 1e-3
    assert (torch.cat(pieces, 1) - full).abs().max().item() < 1e-3
