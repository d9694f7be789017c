"""Named model configurations with published shapes, built with random weights for speed and memory runs.

Random weights are fine for latency and memory (the arithmetic does not depend on the values); accuracy is
measured with `retrofit eval` on real checkpoints.
"""
from __future__ import annotations

import torch

from retrofit.errors import RetrofitError
from retrofit.memory import available_bytes
from retrofit.registry import Registry

MODEL_CONFIGS: Registry = Registry("model config")


@MODEL_CONFIGS.register("llama3-8b")
def llama3_8b():
    """Meta-Llama-3.1-8B shapes: hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocab 128256."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128001)


@MODEL_CONFIGS.register("qwen2.5-7b")
def qwen25_7b():
    """Qwen2.5-7B shapes: hidden 3584, 28 layers, 28 heads / 4 KV heads, MLP 18944, vocab 152064, QKV bias."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=151643, eos_token_id=151643)


@MODEL_CONFIGS.register("smollm2-135m")
def smollm2_135m():
    """SmolLM2-135M shapes: hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocab 49152, tied."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                       rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2)


def build_random_model(name: str, dtype: torch.dtype, device: torch.device, layers: int | None = None):
    """The named config with random weights, created directly on ``device`` in ``dtype`` (no CPU copy).

    ``layers`` truncates the depth (for quick runs)."""
    from transformers import AutoModelForCausalLM

    config = MODEL_CONFIGS.get(name)()
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise RetrofitError(f"--layers must be in 1..{config.num_hidden_layers} for {name}, got {layers}")
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.use_cache = True
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def check_fits(skeleton, device: torch.device, dtype: torch.dtype) -> None:
    """RetrofitError unless the weights of ``skeleton`` (a model of meta tensors: shapes only) fit in the memory
    ``device`` has free, so that an 8B config on a small machine is refused in one line, not killed by the OS."""
    needed = sum(p.numel() for p in skeleton.parameters()) * torch.empty((), dtype=dtype).element_size()
    free = available_bytes(device)
    if free is not None and needed > free:
        raise RetrofitError(f"the weights need {needed / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}; "
                            f"{device} has {free / 2**30:.1f} GiB free (try --dtype bfloat16, --layers N or another "
                            "--device)")

