"""Batched log-likelihood of continuations given contexts (the scoring core of multiple choice and LAMBADA).

Tokenization follows lm-evaluation-harness (``TemplateLM._encode_pair``, 0.4.x), so that both harnesses score the
same tokens: trailing whitespace of the context moves to the front of the continuation (PIQA's queries end in
``"\n"``), then the context and the context + continuation are each encoded WITHOUT special tokens, and the
continuation tokens are ``encode(context + continuation)`` past ``len(encode(context))``. The model input is
``(context + continuation)[:-1]``, left-truncated to the model's maximum length.

Batches are right-padded; causal attention means the real tokens of a row never see its padding, so results
equal batch size 1 up to float rounding (tests/test_eval_scoring.py checks this with numbers).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retrofit.eval.progress import progress_bar
from retrofit.model_info import max_model_length, model_device


@dataclass(frozen=True)
class Request:
    """One (context, continuation) pair as token ids."""

    context_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]


@dataclass(frozen=True)
class Score:
    """Sum of log-probabilities of the continuation tokens and whether each was the greedy argmax."""

    logprob: float
    is_greedy: bool


@dataclass
class Throughput:
    """Tokens run through the model and the seconds it took (for tokens/s per variant)."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: "Throughput") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def encode_pair(tokenizer, context: str, continuation: str) -> Request:
    """Token ids of ``context`` and of ``continuation`` (split from the whole encoding at the context length), after
    moving the context's trailing whitespace into the continuation as lm-evaluation-harness does."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole_ids = tokenizer.encode(context + continuation, add_special_tokens=False)
    return Request(tuple(context_ids), tuple(whole_ids[len(context_ids):]))


@torch.no_grad()
def score_requests(model, requests: list[Request], batch_size: int = 8, desc: str = "loglikelihood",
                   throughput: Throughput | None = None) -> list[Score]:
    """Score each request: ``logprob = sum_t log p(cont_t | context, cont_<t)``, ``is_greedy = all argmax``.

    Args:
        model: a causal LM whose ``forward(input_ids [B, T], attention_mask [B, T])`` returns ``logits [B, T, V]``.
        requests: pairs with a non-empty continuation.
        batch_size: rows per forward; rows are sorted by length (longest first) and right-padded.
        throughput: if given, receives the non-pad tokens run and the seconds spent.

    Returns:
        one Score per request, in the order of ``requests``.
    """
    device = model_device(model)
    limit = max_model_length(model)
    rows = []
    for index, request in enumerate(requests):
        if not request.continuation_ids:
            raise ValueError(f"request {index} has an empty continuation")
        whole = list(request.context_ids) + list(request.continuation_ids)
        inputs = whole[-(limit + 1):][:-1]
        rows.append((index, inputs, len(request.continuation_ids), whole[-len(request.continuation_ids):]))
    order = sorted(rows, key=lambda row: -len(row[1]))
    scores: list[Score | None] = [None] * len(requests)
    progress = progress_bar(len(order), desc, "req")
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        width = max(len(row[1]) for row in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for slot, (_, inputs, _, _) in enumerate(batch):
            input_ids[slot, :len(inputs)] = torch.tensor(inputs)
            attention_mask[slot, :len(inputs)] = 1
        began = time.perf_counter()
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       use_cache=False).logits
        for slot, (index, inputs, n_cont, targets) in enumerate(batch):
            positions = slice(len(inputs) - n_cont, len(inputs))
            logprobs = F.log_softmax(logits[slot, positions].float(), dim=-1)
            target = torch.tensor(targets, device=logprobs.device)
            picked = logprobs.gather(-1, target[:, None]).squeeze(-1)
            scores[index] = Score(float(picked.sum()), bool((logprobs.argmax(-1) == target).all()))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if throughput is not None:
            throughput.add(Throughput(int(attention_mask.sum()), time.perf_counter() - began))
        progress.update(len(batch))
    progress.close()
    return scores  # type: ignore[return-value]
