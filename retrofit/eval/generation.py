"""Batched greedy generation with LEFT padding (the long-context synthetic tasks and generation fidelity decode
through it).

It runs ``retrofit.generate`` (the static-cache engine) on the model as the variant opened it, so a variant that
patches decoding (inside ``sparse_decoding`` the engine drives the session's static sparse cache) is the path that is
measured.
"""
from __future__ import annotations

import time

import torch

from retrofit.eval.loglikelihood import Throughput
from retrofit.eval.progress import progress_bar
from retrofit.generation import eos_token_ids, generate, left_padded, pad_token_id
from retrofit.model_info import model_device


@torch.no_grad()
def greedy_token_ids(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 1,
                     desc: str = "generate", throughput: Throughput | None = None,
                     stop_at_eos: bool = True) -> list[list[int]]:
    """Greedy new token ids after each of the token-id ``prompts``, in the order of ``prompts``.

    Rows of a batch are left-padded to the longest prompt with ``attention_mask`` zeros on the padding (positions
    count real tokens only); prompts are grouped by length to keep padding small. With ``stop_at_eos`` a row ends at
    the model's end-of-sequence token (its list then holds the pad token after it, up to the batch's longest row);
    without, every row gets exactly ``max_new_tokens`` tokens, end tokens included as the model chose them.
    """
    device = model_device(model)
    pad = pad_token_id(tokenizer, model)
    eos = eos_token_ids(model, tokenizer) if stop_at_eos else []
    order = sorted(range(len(prompts)), key=lambda index: -len(prompts[index]))
    outputs: list[list[int] | None] = [None] * len(prompts)
    progress = progress_bar(len(prompts), desc, "prompt")
    for start in range(0, len(order), batch_size):
        indices = order[start:start + batch_size]
        input_ids, attention_mask = left_padded([prompts[index] for index in indices], pad, device)
        began = time.perf_counter()
        generated = generate(model, input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=pad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        new_tokens = generated[:, input_ids.shape[1]:]  # [rows, <= max_new_tokens]
        if throughput is not None:
            produced = int((new_tokens != pad).sum()) if stop_at_eos else new_tokens.numel()
            throughput.add(Throughput(int(attention_mask.sum()) + produced, time.perf_counter() - began))
        for slot, index in enumerate(indices):
            outputs[index] = new_tokens[slot].tolist()
        progress.update(len(indices))
    progress.close()
    return outputs  # type: ignore[return-value]


def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 1,
                    desc: str = "generate", throughput: Throughput | None = None) -> list[str]:
    """Greedy continuations of token-id ``prompts`` (ending at the end-of-sequence token), decoded without special
    tokens, in the order of ``prompts`` (batching: :func:`greedy_token_ids`)."""
    token_ids = greedy_token_ids(model, tokenizer, prompts, max_new_tokens, batch_size, desc, throughput)
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in token_ids]
