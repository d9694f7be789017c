"""Text streamed to a file as it is generated (``retrofit generate``)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

from transformers import TextStreamer

from retrofit.generation.generate import generate
from retrofit.generation.inputs import build_prompt_ids, eos_token_ids, pad_token_id


@dataclass(frozen=True)
class StreamedGeneration:
    """What :func:`stream_generate` produced, and the time of its two parts: the prefill (the prompt's forward up to
    its first new token on the host) and the decode steps after it (``new_tokens - 1`` tokens)."""

    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float

    def summary(self) -> str:
        """``prefill: 1,532 tokens in 0.84 s (1,823 tokens/s) | decode: 127 tokens in 3.10 s (41.0 tokens/s)``"""
        decoded = self.new_tokens - 1
        return (f"prefill: {self.prompt_tokens:,} tokens in {self.prefill_seconds:.2f} s "
                f"({self.prompt_tokens / max(self.prefill_seconds, 1e-9):,.0f} tokens/s) | decode: {decoded:,} tokens "
                f"in {self.decode_seconds:.2f} s ({decoded / max(self.decode_seconds, 1e-9):,.1f} tokens/s)")


class WriterStreamer(TextStreamer):
    """transformers' ``TextStreamer`` writing the new text (prompt skipped, special tokens dropped) to ``out``;
    ``first_token_at`` is the ``time.perf_counter()`` at which the first new token reached it."""

    def __init__(self, tokenizer, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        if not self.next_tokens_are_prompt and self.first_token_at is None:
            self.first_token_at = time.perf_counter()  # the tokens are on the host already: the device has caught up
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text)
        self.out.flush()


def stream_generate(model, tokenizer, prompt: str, chat: bool, max_new_tokens: int, out: TextIO,
                    **sampling) -> StreamedGeneration:
    """Generate after ``prompt`` with :func:`retrofit.generate` (``sampling``: its do_sample, temperature, top_p,
    seed) and write the text to ``out`` as it is produced; returns the token counts and the prefill and decode
    times."""
    input_ids = build_prompt_ids(tokenizer, prompt, chat, next(model.parameters()).device)   # [1, T]
    streamer = WriterStreamer(tokenizer, out)
    started = time.perf_counter()
    output = generate(model, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_ids(model, tokenizer),
                      pad_token_id=pad_token_id(tokenizer, model), streamer=streamer, **sampling)   # [1, T + N]
    ended = time.perf_counter()
    first_token_at = streamer.first_token_at or ended
    return StreamedGeneration(input_ids.shape[1], output.shape[1] - input_ids.shape[1], first_token_at - started,
                              ended - first_token_at)
