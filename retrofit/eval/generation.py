"""Batched greedy generation with LEFT padding (the long-context synthetic tasks decode through it).

It calls the model's own ``generate`` so that a variant that patches generation (sparse decoding installs its
cache and attention there) is the path that is measured.
"""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from retrofit.eval.loglikelihood import Throughput, model_device


def pad_token_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 1,
                    desc: str = "generate", throughput: Throughput | None = None) -> list[str]:
    """Greedy continuations of token-id ``prompts``, decoded without special tokens.

    Rows of a batch are left-padded to the longest prompt with ``attention_mask`` zeros on the padding (the
    model derives position ids from the mask). Prompts are grouped by length to keep padding small; the output
    order is that of ``prompts``.
    """
    device = model_device(model)
    pad = pad_token_id(tokenizer)
    order = sorted(range(len(prompts)), key=lambda index: -len(prompts[index]))
    outputs: list[str | None] = [None] * len(prompts)
    progress = tqdm(total=len(prompts), desc=desc, unit="prompt", leave=False)
    for start in range(0, len(order), batch_size):
        indices = order[start:start + batch_size]
        width = max(len(prompts[index]) for index in indices)
        input_ids = torch.full((len(indices), width), pad, dtype=torch.long)
        attention_mask = torch.zeros(len(indices), width, dtype=torch.long)
        for slot, index in enumerate(indices):
            prompt = prompts[index]
            input_ids[slot, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[slot, width - len(prompt):] = 1
        began = time.perf_counter()
        generated = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                   max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                   temperature=None, top_p=None, top_k=None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        new_tokens = generated[:, width:]
        if throughput is not None:
            produced = int((new_tokens != pad).sum()) if pad is not None else new_tokens.numel()
            throughput.add(Throughput(int(attention_mask.sum()) + produced, time.perf_counter() - began))
        for slot, index in enumerate(indices):
            outputs[index] = tokenizer.decode(new_tokens[slot].tolist(), skip_special_tokens=True)
        progress.update(len(indices))
    progress.close()
    return outputs  # type: ignore[return-value]
