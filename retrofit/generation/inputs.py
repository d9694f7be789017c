"""What a generation is asked: the prompt ids and their left padding, the new-token count, the sampling options, the
tokens that end a row. Everything here is checked before any model work starts (bad input is one RetrofitError)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from retrofit.errors import RetrofitError
from retrofit.model_info import max_model_length


def cache_keyword(model) -> str:
    """The forward argument that takes the cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class SamplingOptions:
    """How each new token is chosen: greedy (``do_sample=False``), or sampled at ``temperature`` from the smallest set
    of tokens whose probability reaches ``top_p``, reproducibly from ``seed``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    @classmethod
    def checked(cls, do_sample: bool, temperature: float | None, top_p: float | None, seed: int | None
                ) -> "SamplingOptions":
        """The options, or a RetrofitError naming the ones that contradict each other."""
        if not do_sample:
            given = [name for name, value in (("temperature", temperature), ("top_p", top_p), ("seed", seed))
                     if value is not None]
            if given:
                raise RetrofitError(f"{', '.join(given)} only apply to sampling: pass do_sample=True "
                                    "(on the command line: a --temperature above 0), or drop them for greedy decoding")
            return cls()
        temperature = 1.0 if temperature is None else float(temperature)
        top_p = 1.0 if top_p is None else float(top_p)
        if not temperature > 0:
            raise RetrofitError(f"temperature={temperature} with do_sample=True: sampling needs a temperature above 0 "
                                "(greedy decoding is do_sample=False)")
        if not 0 < top_p <= 1:
            raise RetrofitError(f"top_p={top_p} is invalid: expected a probability in (0, 1]")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise RetrofitError(f"seed={seed!r} is invalid: expected a non-negative integer")
        return cls(True, temperature, top_p, seed)


def checked_prompt(model, input_ids, attention_mask, max_new_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids ``[B, T]`` long, attention_mask ``[B, T]`` long) on the model's device, or a RetrofitError: ids not
    2-D integers, a mask of another shape, not left-padded or with an empty row, ``max_new_tokens`` <= 0, or the
    prompt plus the new tokens beyond the model's positions."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise RetrofitError(f"max_new_tokens must be a positive number of tokens, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool or input_ids.numel() == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise RetrofitError(f"input_ids must be a non-empty 2-D tensor of token ids [batch, length], got {shape}")
    device = next(model.parameters()).device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise RetrofitError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
    mask = attention_mask.to(torch.long).cpu()
    lengths = mask.sum(-1)
    if bool((lengths == 0).any()):
        raise RetrofitError("a prompt row has no token (its attention_mask is all zeros)")
    left_padded = mask.flip(-1).cumprod(-1).sum(-1) == lengths  # the ones of each row run up to its last column
    if not bool(left_padded.all()):
        raise RetrofitError("prompts must be left-padded (tokenizer.padding_side = 'left'): the attention_mask has "
                            "zeros after a row's first token")
    limit = max_model_length(model)
    longest = int(lengths.max())
    if longest + max_new_tokens > limit:
        raise RetrofitError(f"the prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} is over the model's "
                            f"limit of {limit} positions (max_position_embeddings)")
    return input_ids.to(device=device, dtype=torch.long), mask.to(device)


def eos_token_ids(model, tokenizer=None) -> list[int]:
    """The tokens that end a row, as transformers' ``generate`` reads them: the model's generation config, else the
    tokenizer's end-of-sequence token."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is None and tokenizer is not None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return []
    return [int(configured)] if isinstance(configured, int) else [int(token) for token in configured]


def pad_token_id(tokenizer=None, model=None) -> int:
    """The token finished rows are filled with: the tokenizer's (or generation config's) pad token, else its
    end-of-sequence token, else 0."""
    config = getattr(model, "generation_config", None)
    candidates = (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None),
                  getattr(tokenizer, "eos_token_id", None), (eos_token_ids(model) or [None])[0] if model else None)
    for candidate in candidates:
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


def build_prompt_ids(tokenizer, prompt: str, chat: bool, device: torch.device) -> torch.Tensor:
    """Token ids ``[1, T]`` of the prompt, wrapped in the chat template when ``chat``."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=not chat).input_ids.to(device)
