"""Generation: one prefill, then one token per decode step, for a dense model, a hybrid, or a model inside
``retrofit.sparse_decoding(...)``. ``retrofit generate``, eval's generation tasks and ``retrofit bench`` run this loop.

    logits, state = prefill(model, input_ids, attention_mask)       # logits of the last position [B, V]
    logits = decode_step(model, next_tokens, state)                # one new token per row
    ids = decode_n(model, input_ids, attention_mask, max_new_tokens=64)   # [B, T + N], greedy by default

Rows may be left-padded (``attention_mask`` zeros before each row's prompt): positions count real tokens only, as in
transformers' ``generate``, whose greedy tokens this loop reproduces. The cache is transformers' own
(``DynamicCache(config=...)``: key/value layers for softmax attention, linear-attention layers for a hybrid's
converted ones); inside ``sparse_decoding`` the session replaces it by its sparse cache.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, TextIO

import torch
from transformers import TextStreamer
from transformers.cache_utils import Cache, DynamicCache


@dataclass
class DecodeState:
    """What decoding carries from step to step: the cache, the 2-D mask of every position so far ``[B, S]`` (1 for
    real tokens), and the position id of each row's next token ``[B]``."""

    cache: Cache
    attention_mask: torch.Tensor
    next_position: torch.Tensor


def cache_keyword(model) -> str:
    """The forward argument that takes the cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _forward(model, input_ids: torch.Tensor, state: DecodeState, position_ids: torch.Tensor) -> torch.Tensor:
    output = model(input_ids=input_ids, attention_mask=state.attention_mask, position_ids=position_ids,
                   use_cache=True, logits_to_keep=1, **{cache_keyword(model): state.cache})
    returned = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
    if returned is not None:
        state.cache = returned  # the sparse session may have put its own cache in place of the one passed
    return output.logits[:, -1]


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, DecodeState]:
    """Run the prompt ``input_ids [B, T]`` (``attention_mask [B, T]``, 0 on left padding) through the model ->
    (logits of each row's last position ``[B, V]``, the :class:`DecodeState` to decode from)."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    state = DecodeState(DynamicCache(config=model.config), attention_mask, positions[:, -1] + 1)
    return _forward(model, input_ids, state, positions), state


@torch.no_grad()
def decode_step(model, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Feed one new token per row ``tokens [B]`` -> logits of the next one ``[B, V]``; advances ``state``."""
    state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones(len(tokens), 1)], dim=1)
    logits = _forward(model, tokens[:, None], state, state.next_position[:, None])
    state.next_position = state.next_position + 1
    return logits


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits ``[B, V]`` -> the most likely token of each row ``[B]``."""
    return logits.argmax(-1)


def sampler(temperature: float, generator: torch.Generator | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sampling at ``temperature`` (> 0) from the softmax of the logits; 0 is :func:`greedy`."""
    if temperature <= 0:
        return greedy

    def sample(logits: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probabilities, 1, generator=generator)[:, 0]

    return sample


@torch.no_grad()
def decode_n(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
             choose: Callable[[torch.Tensor], torch.Tensor] = greedy, eos_token_id: int | list[int] | None = None,
             pad_token_id: int = 0, on_tokens: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Prefill, then up to ``max_new_tokens`` decode steps -> ``[B, T + N]`` ids (prompt first).

    ``choose(logits [B, V]) -> [B]`` picks each token (:func:`greedy`, or :func:`sampler`). A row that produced
    ``eos_token_id`` continues with ``pad_token_id``; decoding stops when every row has. ``on_tokens([B])`` sees each
    step's tokens (streaming).
    """
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []),
                       device=input_ids.device, dtype=torch.long)
    logits, state = prefill(model, input_ids, attention_mask)
    finished = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
    produced = []
    for step in range(max_new_tokens):
        tokens = torch.where(finished, pad_token_id, choose(logits))
        produced.append(tokens)
        if on_tokens is not None:
            on_tokens(tokens)
        finished |= torch.isin(tokens, eos)
        if step + 1 == max_new_tokens or bool(finished.all()):
            break
        logits = decode_step(model, tokens, state)
    return torch.cat([input_ids, torch.stack(produced, 1)], dim=1) if produced else input_ids


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """The tokens that end a row, as transformers' ``generate`` reads them: the model's generation config, else the
    tokenizer's end-of-sequence token."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is None and tokenizer is not None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return []
    return [int(configured)] if isinstance(configured, int) else [int(token) for token in configured]


def pad_token_id(tokenizer) -> int:
    """The token padded rows are filled with: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    return 0


def left_padded(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts -> (``input_ids [B, T]``, ``attention_mask [B, T]``), each row left-padded to the longest."""
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids.to(device), attention_mask.to(device)


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


def stream_generate(model, tokenizer, prompt: str, chat: bool, max_new_tokens: int, temperature: float,
                    out: TextIO) -> int:
    """Generate after ``prompt`` and write the text to ``out`` as it is produced; returns the number of new tokens."""
    input_ids = build_prompt_ids(tokenizer, prompt, chat, model.device)
    streamer = _WriterStreamer(tokenizer, out)
    output = decode_n(model, input_ids, max_new_tokens=max_new_tokens, choose=sampler(temperature),
                      eos_token_id=eos_token_ids(model, tokenizer), pad_token_id=pad_token_id(tokenizer),
                      on_tokens=lambda tokens: streamer.put(tokens.cpu()))
    streamer.end()
    return output.shape[1] - input_ids.shape[1]
