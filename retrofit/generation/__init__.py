"""Generation for a dense model, a hybrid, or a model inside ``retrofit.sparse_decoding(...)``: one engine.

    ids = retrofit.generate(model, input_ids, attention_mask, max_new_tokens=64)        # [B, T + N]

``inputs.py`` (what is asked, checked before any model work), ``engine.py`` (the static cache, the chunked prefill and
the decode step that touches only device tensors), ``sampling.py`` (greedy / seeded top-p sampling on the device),
``graphs.py`` (the step captured as a CUDA graph), ``generate.py`` (the loop: host reads every K tokens),
``kept.py`` (the last call's cache and graph, kept per model for the next call of the same shape),
``streaming.py`` (text to a file as it comes, for ``retrofit generate``).
"""
from retrofit.generation.engine import CAPACITY_QUANTUM, StaticGeneration, cache_capacity
from retrofit.generation.generate import DecodeLoop, generate
from retrofit.generation.kept import kept_generation, release
from retrofit.generation.inputs import (SamplingOptions, build_prompt_ids, cache_keyword, checked_prompt,
                                        eos_token_ids, left_padded, pad_token_id)
from retrofit.generation.streaming import StreamedGeneration, WriterStreamer, stream_generate

__all__ = ["CAPACITY_QUANTUM", "DecodeLoop", "SamplingOptions", "StaticGeneration", "StreamedGeneration",
           "WriterStreamer", "build_prompt_ids", "cache_capacity", "cache_keyword", "checked_prompt", "eos_token_ids", "generate",
           "kept_generation", "left_padded", "pad_token_id", "release", "stream_generate"]
