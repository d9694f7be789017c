"""Streaming text generation shared by `retrofit generate` and the examples."""
from __future__ import annotations

from typing import TextIO

import torch
from transformers import TextStreamer


class _WriterStreamer(TextStreamer):
    def __init__(self, tokenizer, out: TextIO):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.out = out

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text)
        self.out.flush()


def build_prompt_ids(tokenizer, prompt: str, chat: bool, device: torch.device) -> torch.Tensor:
    """Token ids ``[1, T]`` of the prompt, wrapped in the chat template when ``chat``."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=not chat).input_ids.to(device)


@torch.inference_mode()
def stream_generate(model, tokenizer, prompt: str, chat: bool, max_new_tokens: int, temperature: float,
                    out: TextIO) -> int:
    """Generate and write text to ``out`` as it is produced; returns the number of new tokens."""
    input_ids = build_prompt_ids(tokenizer, prompt, chat, model.device)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            streamer=_WriterStreamer(tokenizer, out), pad_token_id=tokenizer.pad_token_id
                            or tokenizer.eos_token_id, top_p=None, top_k=None, **sampling)
    return output.shape[1] - input_ids.shape[1]
