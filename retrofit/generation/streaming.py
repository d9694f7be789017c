"""Text streamed to a file as it is generated (``retrofit generate``)."""
from __future__ import annotations

from typing import TextIO

from transformers import TextStreamer

from retrofit.generation.generate import generate
from retrofit.generation.inputs import build_prompt_ids, eos_token_ids, pad_token_id


class WriterStreamer(TextStreamer):
    """transformers' ``TextStreamer`` writing the new text (prompt skipped, special tokens dropped) to ``out``."""

    def __init__(self, tokenizer, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text)
        self.out.flush()


def stream_generate(model, tokenizer, prompt: str, chat: bool, max_new_tokens: int, out: TextIO,
                    **sampling) -> int:
    """Generate after ``prompt`` with :func:`retrofit.generate` (``sampling``: its do_sample, temperature, top_p,
    seed) and write the text to ``out`` as it is produced; returns the number of new tokens."""
    input_ids = build_prompt_ids(tokenizer, prompt, chat, next(model.parameters()).device)
    output = generate(model, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_ids(model, tokenizer),
                      pad_token_id=pad_token_id(tokenizer, model), streamer=WriterStreamer(tokenizer, out),
                      **sampling)
    return output.shape[1] - input_ids.shape[1]
