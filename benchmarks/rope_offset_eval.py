"""`retrofit eval` with every rotary position shifted by a fixed offset: the same prompts, read at later absolute
positions. RoPE attention depends only on relative positions, so the dense model's scores stay (up to rounding);
anything that learned absolute RoPE phases — SeerAttention gates trained at one sequence length read post-RoPE
queries and keys — shows it here. Llama-style models (LlamaRotaryEmbedding), e.g. the reference SmolLM2.

    ROPE_OFFSET=5952 python benchmarks/rope_offset_eval.py smollm2-135m --tasks niah_single --context-length 2048 \
        --limit 1 --num-seeds 10 --device cpu --variant seer:budget=1024,gate_path=GATES

(arguments as for `retrofit eval`; offset + context length must stay within max_position_embeddings, 8192 here)
"""
import os
import sys

from transformers.models.llama import modeling_llama

from retrofit._entry import cli_module


def main() -> None:
    offset = int(os.environ.get("ROPE_OFFSET", "0"))
    rotary_forward = modeling_llama.LlamaRotaryEmbedding.forward

    def shifted(self, x, position_ids):
        return rotary_forward(self, x, position_ids + offset)

    modeling_llama.LlamaRotaryEmbedding.forward = shifted
    cli_module().main(["eval", *sys.argv[1:]], standalone_mode=True)


if __name__ == "__main__":
    main()
